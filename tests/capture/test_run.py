"""`hstap capture` end to end on real ShareGPT records: store contents, resume, SIGKILL, bad input, CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hstap.cli import main
from hstap.data import SkipReport, render_all
from hstap.store import open_store, verify_store

ROOT = Path(__file__).resolve().parents[2]


def _expected(tokenizer, limit, max_tokens=256):
    return render_all("sharegpt", tokenizer, SkipReport(), max_tokens=max_tokens, limit=limit)


def _capture_args(out, limit, *extra):
    return ["capture", "--limit", str(limit), "--out", str(out), "--max-tokens", "256", "--batch-tokens", "1024",
            *extra]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("cap") / "store"
    assert main(_capture_args(out, 6, "--shard-mb", "0.5")) == 0
    return out


def test_store_holds_exactly_the_rendered_samples(small_store, target):
    expected = _expected(target.tokenizer, 6)
    store = open_store(small_store)
    assert store.ids() == [s.id for s in expected]
    assert len(store.manifest.shards) > 1, "small shards: the run must have committed several"
    assert store.manifest.meta.layer_ids == [1, 14, 26]
    assert store.manifest.meta.model_fingerprint == target.fingerprint
    for sample, ref in zip(store, expected):
        assert sample["input_ids"].tolist() == ref.input_ids
        assert sample["loss_mask"].tolist() == ref.loss_mask
        assert set(sample["hidden"]) == {1, 14, 26}
        assert set(sample["teacher"]) == {"topk_ids", "topk_logprobs"}


def test_stored_hidden_equals_an_independent_forward(small_store, target):
    sample = open_store(small_store)[2]
    with torch.inference_mode():
        out = target.model(input_ids=sample["input_ids"][None], output_hidden_states=True)
    for k in (1, 14, 26):
        ref = out.hidden_states[k + 1][0].to(torch.bfloat16)
        # batched with padding vs alone: equal up to fp32 reassociation, then bf16 rounding
        torch.testing.assert_close(sample["hidden"][k].float(), ref.float(), atol=0.02, rtol=0.01)
    assert torch.equal(sample["teacher"]["topk_ids"][:, 0].long(), out.logits[0].argmax(-1))


def test_rerun_resumes_and_extends(small_store, target, capsys):
    assert main(_capture_args(small_store, 9, "--shard-mb", "0.5")) == 0
    out = capsys.readouterr().out
    assert "resumed past 6 already-committed samples" in out
    store = open_store(small_store)
    assert store.ids() == [s.id for s in _expected(target.tokenizer, 9)]
    assert verify_store(small_store) == []


def test_store_cli_info_and_verify(small_store, capsys):
    assert main(["store", "info", str(small_store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] >= 6 and info["layer_ids"] == [1, 14, 26] and info["hidden_size"] == 576
    assert main(["store", "verify", str(small_store)]) == 0


def test_corrupt_shard_is_named_by_verify(small_store, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_store, copy)
    shard = sorted(copy.glob("shard-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["store", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert shard.name in out and out.count("BAD") == 1


def test_changed_layers_on_resume_is_refused(small_store, capsys):
    assert main(_capture_args(small_store, 9, "--layers", "2,14,26")) == 2
    err = capsys.readouterr().err
    assert "layer_ids" in err and err.count("\n") == 1


def test_short_disk_is_refused_unless_forced(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    assert main(_capture_args(tmp_path / "s", 2)) == 2
    assert "--force" in capsys.readouterr().err
    assert main(_capture_args(tmp_path / "s", 2, "--force")) == 0


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    assert main(_capture_args(tmp_path / "s", 5, "--data", f"jsonl:{bad}")) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and err.count("\n") == 1
    assert main(_capture_args(tmp_path / "s", 5, "--data", "nope")) == 2
    assert "sharegpt" in capsys.readouterr().err


def test_plan_prints_resolved_config_as_a_config_file(tmp_path, capsys):
    """`--plan` resolves `auto` against the model and prints YAML that `--config` reads back unchanged."""
    assert main(_capture_args(tmp_path / "s", 3, "--plan")) == 0
    text = capsys.readouterr().out
    plan = yaml.safe_load(text)["capture"]
    assert plan["limit"] == 3 and plan["layers"] == [1, 14, 26] and plan["teacher"] == "topk:32"
    assert not (tmp_path / "s").exists()
    (tmp_path / "run.yaml").write_text(text)
    assert main(["capture", "--config", str(tmp_path / "run.yaml"), "--plan"]) == 0
    assert capsys.readouterr().out == text


def _shards(out: Path) -> int:
    return len(json.loads((out / "manifest.json").read_text())["shards"])


def test_sigkill_at_several_points_then_resume_is_exact(tmp_path, target):
    """Each run SIGKILLs itself right after its n-th committed shard (HSTAP_FAULT, no timer): the store keeps
    exactly the committed shards, every one whole, and a resume completes the exact sample set. The killed runs
    are processes (a SIGKILL ends the process); the completing resume runs in this one, which proves the same
    and saves an interpreter start-up (~5 s of a core)."""
    out = tmp_path / "killed"
    limit = 12  # short samples, one per 0.1 MiB shard: the property is about commits, not about sizes
    args = _capture_args(out, limit, "--shard-mb", "0.1", "--batch-tokens", "256", "--max-tokens", "48")
    cmd = [sys.executable, "-m", "hstap.cli", *args]
    committed = 0
    for kill_after_shards in (1, 2):  # a first run, then a resumed run, each killed
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HSTAP_FAULT": f"shard-committed:{kill_after_shards}"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        committed += kill_after_shards
        assert _shards(out) == committed  # the kill came right after that commit, and nothing after it
        assert verify_store(out) == []  # every committed shard is whole
    assert main(args) == 0
    assert _shards(out) > committed
    store = open_store(out)
    ids = store.ids()
    assert len(ids) == len(set(ids)), "duplicate samples after resume"
    assert ids == [s.id for s in _expected(target.tokenizer, limit, max_tokens=48)]
    assert verify_store(out) == []
    assert not list(out.glob("*.tmp"))
