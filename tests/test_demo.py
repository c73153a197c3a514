"""`hstap demo` end to end on the smoke preset: every stage runs and the final table names the outputs."""

from hstap.cli import main


def test_demo_smoke_runs_every_stage(tmp_path, capsys):
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for stage in ("synth", "capture", "train", "eval", "export"):
        assert f"── {stage}" in out
    assert "τ, " in out and "speedup" in out
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    assert (tmp_path / "drafter" / "report.md").exists()
    assert (tmp_path / "export-sglang" / "config.json").exists()
    # a second run reuses what the first left: synth and capture resume with nothing to do
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path)]) == 0
    again = capsys.readouterr().out
    assert "0 conversations to generate" in again and "0 samples" in again


def test_online_preset_skips_the_store_and_stages_pick_a_subset(tmp_path, capsys, monkeypatch):
    """The gpu preset's path (online training under a time budget), on the smoke preset's sizes and the CPU."""
    import dataclasses

    from hstap import demo

    online = dataclasses.replace(demo.PRESETS["smoke"], online=True, train_budget_s=600)
    monkeypatch.setitem(demo.PRESETS, "smoke", online)
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path), "--stages", "synth,capture,train"]) == 0
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
