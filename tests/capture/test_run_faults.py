"""`hstap capture` under faults: SIGTERM keeps the buffered work, checks refuse before the model loads, a lost
manifest is rebuilt, a damaged store is refused or repaired, a full disk is one line and resumes.

In-process runs reuse the session's loaded SmolLM2 (`loaded_once`): what is tested is everything around the load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from hstap import faults
from hstap.capture.run import make_batches
from hstap.cli import main
from hstap.data import SkipReport, render_all
from hstap.store import StoreWriter, open_store, verify_store

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS, BATCH_TOKENS = 64, 64  # one or two short conversations per forward
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Opposite of hot?", "Two plus two?"]
LIMIT = len(QUESTIONS)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Four short conversations as `hstap synth` writes them: cheap forwards, several batches and shards."""
    path = tmp_path_factory.mktemp("data") / "convs.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                                     {"role": "assistant", "content": "Short."}]})
                            + "\n" for i, q in enumerate(QUESTIONS)))
    return f"jsonl:{path}"


@pytest.fixture
def args(data):
    def make(out, *extra):
        return ["capture", "--data", data, "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--batch-tokens",
                str(BATCH_TOKENS), *extra]

    return make


@pytest.fixture
def expected(data, tokenizer) -> list[str]:
    return [s.id for s in render_all(data, tokenizer, SkipReport(), max_tokens=MAX_TOKENS)]


@pytest.fixture
def loaded_once(target, monkeypatch):
    """`hstap capture` in this process with the session's model instead of a fresh load; counts the loads."""
    loads = []

    def load(*args, **kwargs):
        loads.append(args)
        return target

    monkeypatch.setattr("hstap.capture.run.load_target", load)
    return loads


@pytest.fixture
def no_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before a check that needs no model")

    monkeypatch.setattr("hstap.capture.run.load_target", load)


def _one_line(capsys) -> str:
    """The captured stderr's last line, checked to be the CLI's one-line error (a progress bar may precede it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    last = err.splitlines()[-1]
    assert last.startswith("hstap: error: "), err
    return last


def test_sigterm_commits_the_buffer(tmp_path, args, expected, data, tokenizer):
    """A real process sends itself SIGTERM after its 2nd batch (HSTAP_FAULT, no timer). Shards are 256 MiB and
    commit every 60 s, so before the handler nothing was committed: now exactly the samples of those two batches
    are, the exit code is 143 and the last line says so. (Resumes after SIGTERM and SIGINT: test_crash_loops.)"""
    out = tmp_path / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HSTAP_FAULT": "batch-forwarded:2:TERM"}
    proc = subprocess.run([sys.executable, "-m", "hstap.cli", *args(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hstap: stopped by SIGTERM: ") and "re-run the same command to resume" in last
    samples = render_all(data, tokenizer, SkipReport(), max_tokens=MAX_TOKENS)
    first_two = [s.id for batch in list(make_batches(samples, BATCH_TOKENS))[:2] for s in batch]
    assert len(first_two) < len(expected)
    assert open_store(out).ids() == first_two and verify_store(out) == []
    assert f"{len(first_two)} samples committed" in last


def test_a_kill_once_the_first_commit_is_due_keeps_the_first_batch(tmp_path, args, data, tokenizer):
    """Issue 43: `--commit-every 5s`, first batch done at ~8 s, `kill -9` at 17 s: 0 samples kept, because the
    commit waited for the next batch's samples. Now the tap's writer thread commits as soon as a whole batch is in
    and the interval is due. The run SIGKILLs itself right after its first batch was stored (HSTAP_FAULT
    `batch-stored:1`, no timer; `--commit-every 1ms` is due by then: the model load alone takes longer): that
    batch's samples are committed, whole."""
    out = tmp_path / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HSTAP_FAULT": "batch-stored:1"}
    proc = subprocess.run([sys.executable, "-m", "hstap.cli", *args(out, "--commit-every", "0.001")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    samples = render_all(data, tokenizer, SkipReport(), max_tokens=MAX_TOKENS)
    first = [s.id for s in next(iter(make_batches(samples, BATCH_TOKENS)))]
    assert open_store(out).ids() == first and verify_store(out) == []


def test_commit_every_is_a_duration_flag(tmp_path, args, capsys):
    assert main(args(tmp_path / "s", "--commit-every", "2m", "--plan")) == 0
    assert "commit_every: 120.0" in capsys.readouterr().out
    assert main(args(tmp_path / "s", "--commit-every", "soon", "--plan")) == 2
    assert "capture.commit_every (--commit-every): expected a duration" in _one_line(capsys)


def test_checks_refuse_before_the_model_loads(tmp_path, args, data, no_load, monkeypatch, capsys):
    """Layer range, the writer lock, the store's state and the disk estimate each refuse in one line, and none of
    them costs a model load (`no_load` fails the test if one happens)."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.layers import parse_layers
    from hstap.capture.run import capture_meta, target_files

    out = tmp_path / "store"
    assert main(args(out, "--layers", "1,14,99")) == 2
    assert "ids [99] out of range" in _one_line(capsys)

    cfg = CaptureConfig(out=out, data=data, max_tokens=MAX_TOKENS)
    files = target_files(cfg.model)
    meta = capture_meta(files, parse_layers(cfg.layers, files.num_layers), cfg, cfg.teacher)
    with StoreWriter(out, meta):  # a capture running on this --out holds the lock
        manifest = (out / "manifest.json").read_bytes()
        assert main(args(out)) == 2
        assert "another writer holds" in _one_line(capsys)
    assert (out / "manifest.json").read_bytes() == manifest, "the refused capture wrote nothing"

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    assert main(args(out)) == 2
    assert "only 1.0 kB free: free space or pass --force" in _one_line(capsys)


def test_lost_manifest_is_rebuilt_then_a_deleted_shard_is_refused_then_repaired(tmp_path, args, expected,
                                                                                 loaded_once, capsys):
    out = tmp_path / "store"
    assert main(args(out, "--shard-mb", "0.1")) == 0
    shards = sorted(p.name for p in out.glob("shard-*"))
    assert len(shards) > 2 and len(loaded_once) == 1
    (out / "manifest.json").unlink()
    capsys.readouterr()
    assert main(args(out, "--shard-mb", "0.1")) == 0
    text = capsys.readouterr().out
    assert f"store: rebuilt manifest.json from the headers of {len(shards)} shards ({LIMIT} samples)" in text
    assert f"resumed past {LIMIT} already-committed samples" in text
    assert len(loaded_once) == 1, "a finished store needs no model"
    assert sorted(p.name for p in out.glob("shard-*")) == shards
    assert open_store(out).ids() == expected and verify_store(out) == []

    gone = open_store(out).manifest.shards[1]
    (out / gone.file).unlink()
    assert main(args(out, "--shard-mb", "0.1")) == 2
    err = _one_line(capsys)
    assert f"cannot be resumed: {gone.file}: missing ({len(gone.samples)} samples listed in it)" in err
    assert "--repair" in err
    assert main(args(out, "--shard-mb", "0.1", "--repair")) == 0
    text = capsys.readouterr().out
    assert f"captured {len(gone.samples)} samples" in text and f"store: set aside {gone.file}" in text
    ids = open_store(out).ids()
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids)) and verify_store(out) == []


def test_full_disk_refused_up_front_then_forced_enospc_is_one_line_and_resumes(tmp_path, args, expected,
                                                                             loaded_once, monkeypatch, capsys):
    out = tmp_path / "store"
    usage, real_usage = namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    assert main(args(out, "--shard-mb", "0.1")) == 2
    assert "--force" in _one_line(capsys)
    faults.reset()
    monkeypatch.setenv("HSTAP_FAULT", "shard-write:2:ENOSPC")  # the 2nd shard's write hits a full disk
    assert main(args(out, "--shard-mb", "0.1", "--force")) == 2
    err = _one_line(capsys)
    assert "No space left on device writing shard-00001.safetensors" in err and "re-run the same command" in err
    assert not list(out.glob("*.tmp")) and verify_store(out) == []
    assert 0 < len(open_store(out)) < LIMIT
    monkeypatch.delenv("HSTAP_FAULT")
    monkeypatch.setattr(shutil, "disk_usage", real_usage)  # space freed
    assert main(args(out, "--shard-mb", "0.1")) == 0
    assert open_store(out).ids() == expected and verify_store(out) == []
