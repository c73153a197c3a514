"""`run_eval` and `hstap eval`: vanilla and speculative measured in one run, report files, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from pydantic import ValidationError

from hstap.cli import main
from hstap.drafter import draft_to_target_ids
from hstap.errors import HstapError
from hstap.evaluate.config import EvalConfig
from hstap.evaluate.results import BASELINE_NOISE, EvalResult, Prompt
from hstap.evaluate.run import evaluate_shapes, load_prompts, run_eval
from hstap.runtime.shapes import DraftShape
from tests.evaluate.tiny import tiny_drafter, tiny_target


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
    vanilla_rate = report["vanilla"]["tokens"] / report["vanilla"]["seconds"]
    for s, m in zip(report["shapes"], result.methods, strict=True):  # every shape checked, each against its own
        assert s["greedy_matches_vanilla"] == 3 and s["divergences"] == [] and s["divergences_within_rounding"] == 0
        low, high = s["tau_interval_95"]  # over the 3 prompts
        assert low <= s["tau"] <= high
        assert f"{s['tau']:.2f} ({low:.2f}–{high:.2f})" in (run_dir / "report.md").read_text()
        assert s["draft_ms_per_cycle"] > 0 and s["verify_ms_per_cycle"] > 0 and s["between_ms_per_cycle"] >= 0
        assert s["prefill_ms_per_prompt"] > 0
        # the stages account for (nearly) all of a method's wall time, and nothing twice
        staged = sum(g.prefill_seconds + g.between_seconds + g.draft_seconds + g.verify_seconds for g in m.generations)
        assert 0.8 * m.seconds < staged <= m.seconds, (m.name, staged, m.seconds)
        forwards = sum(len(g.accepted) for g in m.generations)
        assert s["verify_forwards"] == forwards and s["tau"] == pytest.approx(
            sum(sum(g.emitted) for g in m.generations) / forwards, rel=1e-12)
        assert 1.0 <= s["tau"] <= DraftShape.parse(s["shape"]).depth + 1
        assert len(s["acceptance_per_position"]) == DraftShape.parse(s["shape"]).depth
        assert s["tokens_per_second"] == pytest.approx(s["tokens"] / s["seconds"], rel=1e-12)
        assert s["speedup"] == pytest.approx(s["tokens_per_second"] / vanilla_rate, rel=1e-12)
        assert s["speedup_over_tau"] == pytest.approx(s["speedup"] / s["tau"], rel=1e-12)
        assert s["broken_baseline"] == (s["speedup"] > s["tau"] * (1 + BASELINE_NOISE))
        assert sum(s["tokens_per_forward_histogram"].values()) == s["verify_forwards"]
    assert report["per_prompt"][0]["vanilla"]["tokens"] == 6
    md = (run_dir / "report.md").read_text()
    assert "![acceptance_per_position.png]" in md and "tree depth 3, top-2, 4 nodes" in md
    assert "identical to vanilla on 3/3" in result.summary() and "ngram 2 (match ≤ 3)" in md


class ScriptedClock:
    """A clock the test controls: the n-th timed batch lasts `spans[n]` seconds (Methods.run reads the clock at a
    batch's start and at its end)."""

    def __init__(self, spans: list[float]):
        self.spans, self.now, self.reads = spans, 100.0, 0

    def __call__(self) -> float:
        if self.reads % 2:  # a batch's end
            self.now += self.spans[self.reads // 2]
        self.reads += 1
        return self.now


@pytest.fixture(scope="module")
def always_zero():
    """The tiny Llama with every logit 0, so greedy decoding picks token 0 forever (argmax takes the first of a
    tie), and a tiny drafter with every logit 0 too, whose draft id 0 is target token 0: over prompts of zeros,
    prompt lookup and the chain are accepted in full every cycle."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    with torch.no_grad():
        target.lm_head.weight.zero_()
        drafter.lm_head.weight.zero_()
    assert int(draft_to_target_ids(drafter.d2t)[0]) == 0, "the drafter's first draft id must be target token 0"
    return target, drafter


def test_tau_and_speedup_are_the_numbers_the_acceptances_and_the_clock_give(always_zero):
    """τ from acceptances known in advance (every draft accepted: 1 + K tokens per verification), speedup from
    batch times the test sets, each as a number for every shape; a speedup above τ by more than BASELINE_NOISE is
    a broken baseline, one above τ within it is said as such."""
    target, drafter = always_zero
    prompts = [Prompt("a", [0] * 6), Prompt("b", [0] * 5)]
    shapes = [DraftShape.parse("ngram:3"), DraftShape.parse("chain:2")]
    # batch by batch: vanilla, ngram:3, chain:2. 13 tokens each: the prefill's, then 12 from 3 verifications of 4
    # (ngram:3) or 4 of 3 (chain:2)
    clock = ScriptedClock([2.4, 0.5, 0.6, 1.2, 0.375, 0.3])
    vanilla, methods = evaluate_shapes(target, drafter, prompts, shapes, 13, set(), warmup=0, progress=False,
                                       clock=clock)
    assert clock.reads == 12, "two reads per timed batch, nothing else timed by it"
    assert [len(g.tokens) for m in [vanilla, *methods] for g in m.generations] == [13] * 6
    assert [m.verify_forwards for m in [vanilla, *methods]] == [24, 6, 8]
    assert [m.tau for m in [vanilla, *methods]] == [1.0, 4.0, 3.0]
    assert [m.seconds for m in [vanilla, *methods]] == pytest.approx([3.6, 0.875, 0.9])
    assert vanilla.tokens_per_second == pytest.approx(26 / 3.6)
    config = EvalConfig(drafter="tiny", ngram=[3], chain=[2], max_new_tokens=13, warmup=0).resolved()
    target_info = {"model_id": "tiny", "dtype": "fp32", "device": "cpu", "torch_threads": 1}
    result = EvalResult(config=config, target=target_info, prompts=prompts, vanilla=vanilla, methods=methods)
    # ngram:3 4.11 against τ 4: 2.9 % above, within BASELINE_NOISE; chain:2 4.00 against τ 3: broken
    assert [result.speedup(m) for m in methods] == pytest.approx([3.6 / 0.875, 3.6 / 0.9])
    assert [result.speedup_over_tau(m) for m in methods] == pytest.approx([3.6 / 0.875 / 4, 4 / 3])
    assert [result.broken_baseline(m) for m in methods] == [False, True]
    report = result.to_dict()
    assert [(s["tau"], s["broken_baseline"]) for s in report["shapes"]] == [(4.0, False), (3.0, True)]
    assert [s["speedup"] for s in report["shapes"]] == pytest.approx([3.6 / 0.875, 4.0])
    summary = result.summary().splitlines()
    assert summary[1].startswith("ngram 3") and "speedup 4.11x" in summary[1]
    assert summary[2] == ("  speedup above τ by 2.9 %, within timing noise (5 %): a cycle here costs about one "
                          "decoding step")
    assert summary[3].startswith("chain 2") and "speedup 4.00x" in summary[3]
    assert summary[4] == ("  BROKEN BASELINE: speedup 4.00x above τ 3.00: vanilla decoding ran slower than the "
                          "runtime's one-token step can")
    from hstap.evaluate.report import markdown

    md = markdown(report, [])
    assert md.count("x **broken baseline: above τ** |") == 1 and md.count("x *within noise* |") == 1


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
    from hstap.evaluate.methods import Methods

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
