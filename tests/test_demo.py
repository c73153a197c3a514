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
