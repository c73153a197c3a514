"""`hstap demo` is the recipe on SmolLM2: its presets are shipped recipes, its plan is theirs, and its table says in
words what a speedup means. The demo's real run (every stage, killed and resumed, its table) is in
tests/test_recipe.py, which shares one smoke run between the demo and the recipe."""

import contextlib
import io

import pytest

from hstap.cli import main


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("preset", ["cpu", "smoke", "gpu"], ids=lambda p: f"{p}-preset")  # a bare 'gpu' id would
# read as the gpu marker (tests/conftest.py skips those without CUDA)
def test_a_preset_is_the_shipped_recipe_of_its_name(preset, tmp_path):
    """`hstap demo --preset P --plan` prints exactly `hstap recipe --config smollm2-P --plan` (same out)."""
    code, demo, err = _main(["demo", "--preset", preset, "--out", str(tmp_path), "--plan"])
    assert code == 0, err
    code, recipe, err = _main(["recipe", "--config", f"smollm2-{preset}", "--out", str(tmp_path), "--plan"])
    assert code == 0 and demo == recipe, err
    if preset == "gpu":  # what the GPU run needs: the device, online training, a time budget
        assert "device: cuda" in demo and "# training: online (set in the recipe)" in demo
        assert "time_budget_s: 420.0" in demo and "# capture: skip (online training" in demo


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
