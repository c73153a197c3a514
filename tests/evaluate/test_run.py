"""`run_eval` and `hstap eval`: vanilla and speculative measured in one run, report files, one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from hstap.cli import main
from hstap.errors import HstapError
from hstap.evaluate.config import EvalConfig
from hstap.evaluate.run import evaluate_shapes, load_prompts, run_eval
from hstap.runtime.shapes import DraftShape


@pytest.fixture
def run_dir(drafter, target, tmp_path, monkeypatch):
    """A drafter run directory as `hstap train` writes it (no embedding), and the session target reused."""
    out = tmp_path / "drafter"
    drafter.save_pretrained(out, include_embedding=False)
    monkeypatch.setattr("hstap.models.load_target", lambda model, device="cpu", dtype=None: target)
    return out


def test_run_eval_writes_report_into_the_run_directory(run_dir):
    cfg = EvalConfig(drafter=run_dir, limit=3, ngram=[2], chain=[2], tree=["3,2,4"], max_new_tokens=6, batch=2,
                     warmup=0)
    result = run_eval(cfg, progress=False)
    names = sorted(p.name for p in result.files)
    assert names == ["acceptance_per_position.png", "report.json", "report.md", "tau_distribution.png"]
    assert all(p.parent == run_dir and p.stat().st_size > 0 for p in result.files)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["prompts"] == 3 and len(report["per_prompt"]) == 3  # batches of 2 and 1
    assert [s["shape"] for s in report["shapes"]] == ["ngram:2", "chain:2", "tree:3,2,4"]
    for s in report["shapes"]:
        assert s["greedy_matches_vanilla"] == 3
        low, high = s["tau_interval_95"]  # over the 3 prompts
        assert low <= s["tau"] <= high
        assert f"{s['tau']:.2f} ({low:.2f}–{high:.2f})" in (run_dir / "report.md").read_text()
        assert s["draft_ms_per_cycle"] > 0 and s["verify_ms_per_cycle"] > 0 and s["between_ms_per_cycle"] >= 0
        assert s["prefill_ms_per_prompt"] > 0
    for m in result.methods:  # the stages account for (nearly) all of a method's wall time, and nothing twice
        staged = sum(g.prefill_seconds + g.between_seconds + g.draft_seconds + g.verify_seconds for g in m.generations)
        assert 0.8 * m.seconds < staged <= m.seconds, (m.name, staged, m.seconds)
        assert 1.0 <= s["tau"] <= DraftShape.parse(s["shape"]).depth + 1
        assert len(s["acceptance_per_position"]) == DraftShape.parse(s["shape"]).depth
        assert s["speedup"] > 0 and s["tokens_per_second"] > 0
        assert sum(s["tokens_per_forward_histogram"].values()) == s["verify_forwards"]
    assert report["per_prompt"][0]["vanilla"]["tokens"] == 6
    md = (run_dir / "report.md").read_text()
    assert "![acceptance_per_position.png]" in md and "tree depth 3, top-2, 4 nodes" in md
    assert "identical to vanilla on 3/3" in result.summary() and "ngram 2 (match ≤ 3)" in md


def test_ngram_runs_without_a_drafter(target, tmp_path, monkeypatch):
    monkeypatch.setattr("hstap.models.load_target", lambda model, device="cpu", dtype=None: target)
    with pytest.raises(ValidationError, match="needs --drafter"):
        EvalConfig(chain=[2], out=tmp_path)
    result = run_eval(EvalConfig(ngram=[3], limit=1, max_new_tokens=6, warmup=0, out=tmp_path), progress=False)
    assert [m.name for m in result.methods] == ["ngram:3"] and result.greedy_matches(result.methods[0]) == 1
    assert (tmp_path / "report.md").exists()


def test_sampling_runs_on_the_real_target(target, drafter, prompts, stop_ids):
    shapes = [DraftShape.parse("chain:2"), DraftShape.parse("tree:3,2,4")]
    args = (target.model, drafter, prompts[:1], shapes, 6, stop_ids, 0.8, 0, 0, False)
    vanilla, methods = evaluate_shapes(*args)
    again = evaluate_shapes(*args)[1]
    for m, m2 in zip(methods, again):
        assert len(m.generations[0].tokens) == len(vanilla.generations[0].tokens) == 6
        assert m.generations[0].tokens == m2.generations[0].tokens  # seeded: reproducible


def test_warming_each_batch_runs_every_method_untimed_first_and_changes_no_token(target, drafter, prompts, stop_ids,
                                                                                 monkeypatch):
    """warm_each_batch (the CUDA default): before each batch's timed runs, every method decodes that batch for
    one token; what is recorded is the same greedy output as without it."""
    from hstap.evaluate.spec import Methods

    shapes = [DraftShape.parse("chain:2")]
    args = (target.model, drafter, prompts[:2], shapes, 6, stop_ids, 0.0, 0, 0, False)
    calls = []
    real = Methods.run

    def spy(self, shape, batch, new_tokens, *rest, **kw):
        calls.append((shape.spec if shape else "vanilla", len(batch), new_tokens))
        return real(self, shape, batch, new_tokens, *rest, **kw)

    monkeypatch.setattr(Methods, "run", spy)
    vanilla, methods = evaluate_shapes(*args, warm_each_batch=True)
    assert calls == [("vanilla", 1, 1), ("chain:2", 1, 1), ("vanilla", 1, 6), ("chain:2", 1, 6)] * 2
    calls.clear()
    plain_vanilla, plain = evaluate_shapes(*args)  # the default on a CPU
    assert calls == [("vanilla", 1, 6), ("chain:2", 1, 6)] * 2, "off on the CPU by default"
    assert [g.tokens for g in vanilla.generations] == [g.tokens for g in plain_vanilla.generations]
    assert [g.tokens for g in methods[0].generations] == [g.tokens for g in plain[0].generations]
    assert len(methods[0].generations) == 2


def test_prompts_are_first_user_turns(tokenizer, tmp_path):
    path = tmp_path / "chats.jsonl"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    path.write_text(json.dumps({"id": "a", "messages": msgs}) + "\n")
    (prompt,) = load_prompts(f"jsonl:{path}", tokenizer)
    text = tokenizer.decode(prompt.ids)
    assert "Be brief." in text and "Hi" in text and "Hello" not in text and text.endswith("assistant\n")
    mt = load_prompts("mt-bench", tokenizer, limit=1)[0]
    assert mt.id == "mt-bench-81" and "Hawaii" in tokenizer.decode(mt.ids)


def test_cli_json_and_plan(run_dir, capsys):
    assert main(["eval", "--drafter", str(run_dir), "--limit", "1", "--max-new-tokens", "4", "--chain", "2",
                 "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shapes"][0]["shape"] == "chain:2" and report["config"]["bench"] == "mt-bench"
    assert main(["eval", "--drafter", str(run_dir), "--tree", "8,8,60", "--chain", "3", "--plan"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["eval"]["shapes"] == ["chain:3", "tree:8,8,60"]
    assert main(["eval", "--drafter", str(run_dir), "--plan"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["eval"]["shapes"] == ["ngram:3", "chain:3"]


def test_cli_errors_are_one_line(run_dir, capsys):
    assert main(["eval", "--drafter", str(run_dir), "--tree", "2,2,9", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tree:DEPTH,TOPK,NODES" in err
    with pytest.raises(ValidationError):
        EvalConfig(drafter=run_dir, max_new_tokens=1)
    with pytest.raises(ValidationError):
        EvalConfig(drafter=run_dir, bogus=1)


def test_drafter_for_another_target_is_refused(run_dir):
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "target_fingerprint": "0000"}))
    with pytest.raises(HstapError, match="fingerprint 0000"):
        run_eval(EvalConfig(drafter=run_dir, limit=1), progress=False)
