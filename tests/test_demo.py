"""`hstap demo` end to end on the smoke preset: every stage runs and the final table names the outputs."""

import contextlib
import dataclasses
import io
import shutil

import pytest

from hstap.cli import main


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One full smoke-preset run (synth → capture → train → eval → export) and its console output."""
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--preset", "smoke", "--out", str(out)]) == 0
    return out, printed.getvalue()


def test_demo_smoke_runs_every_stage(smoke_run):
    out, printed = smoke_run
    for stage in ("synth", "capture", "train", "eval", "export"):
        assert f"── {stage}" in printed
    assert "τ, " in printed and "speedup" in printed
    # the GPU recipe's shipped drafter beside the demo's, with this machine's break-even τ
    assert "the shipped drafter 'reference' (the GPU recipe's) on the same questions" in printed
    assert "break-even" in printed
    assert (out / "eval-shipped" / "report.md").exists()
    assert (out / "drafter" / "model.safetensors").exists()
    assert (out / "drafter" / "report.md").exists()
    assert (out / "export-sglang" / "config.json").exists()


def test_a_second_run_reuses_what_the_first_left(smoke_run, capsys):
    out, _ = smoke_run
    assert main(["demo", "--preset", "smoke", "--out", str(out), "--stages", "synth,capture"]) == 0
    again = capsys.readouterr().out
    assert "0 conversations to generate" in again and "0 samples" in again


def test_online_preset_skips_the_store_and_stages_pick_a_subset(smoke_run, tmp_path, capsys, monkeypatch):
    """The gpu preset's path (online training under a time budget), on the smoke preset's sizes and the CPU,
    from the smoke run's regenerated answers."""
    from hstap import demo

    for name in ("prompts.jsonl", "synth.jsonl"):
        shutil.copy(smoke_run[0] / name, tmp_path / name)
    online = dataclasses.replace(demo.PRESETS["smoke"], online=True, train_budget_s=600)
    monkeypatch.setitem(demo.PRESETS, "smoke", online)
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path), "--stages", "capture,train"]) == 0
    out = capsys.readouterr().out
    assert "online preset" in out and "── train" in out and "── eval" not in out and "── export" not in out
    assert not (tmp_path / "store").exists()
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    assert '"kind": "budget"' in (tmp_path / "drafter" / "metrics.jsonl").read_text()


def test_unknown_stage_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path), "--stages", "synth,trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo.stages (--stages): expected a comma-separated subset of" in err
    assert "'synth,trian'" in err


def test_the_verdict_says_plainly_whether_a_shape_pays():
    """The demo's table says in words what a shape's speedup means on this machine (hstap.demo.verdict)."""
    from types import SimpleNamespace

    from hstap.demo import verdict

    def result(speedup: float) -> SimpleNamespace:
        return SimpleNamespace(speedup=lambda m: speedup, broken_baseline=lambda m: speedup > m.tau)

    shape = SimpleNamespace(tau=1.8)
    assert verdict(result(0.93), shape) == "does not pay on this machine: slower than vanilla decoding"
    assert verdict(result(1.25), shape) == "pays on this machine"
    assert verdict(result(2.22), shape).startswith("BROKEN BASELINE: above τ 1.80")
