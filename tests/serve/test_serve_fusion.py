"""`hstap serve` with capture on stops when SGLang's log says it enabled its FlashInfer all-reduce fusion (the fused
kernel calls the next layer's input norm as a method, so the capture hooks on it never run), and only then: a fusion
the enforce-disable flag turned off at once, or any fusion while not capturing, serves on."""

from __future__ import annotations

import subprocess
import time

from tests.serve.test_supervisor import ROOT, _cleanup, _none_alive, _pids, _serve, serve_then_ctrl_c

CAPTURE = ("--capture-layers", "1,14,26")


def test_an_enabled_fusion_stops_serve_in_one_line(tmp_path):
    cmd, env = _serve(tmp_path, "fusion", "--capture-dir", str(tmp_path / "cap"), *CAPTURE)
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        final = done.stdout.strip().splitlines()[-1]
        assert final.startswith("hstap serve: error: SGLang enabled its FlashInfer all-reduce fusion for "
                                "KimiK25ForConditionalGeneration") and "engine stopped" in final, done.stdout
        assert "--enforce-disable-flashinfer-allreduce-fusion" in final
        assert "ready on" not in done.stdout
        assert time.monotonic() - start < 30
        assert _none_alive(_pids(tmp_path))
    finally:
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


def _serves_until_ctrl_c(tmp_path, mode: str, *extra: str) -> None:
    before_ready, _ = serve_then_ctrl_c(tmp_path, mode, *extra)
    assert "Auto-enabling FlashInfer AllReduce Fusion" in before_ready  # it was seen, and serve went on


def test_a_fusion_disabled_on_the_next_line_serves_on(tmp_path):
    """What SGLang logs for Kimi-K2.5 at tp 8 on sm90 with hstap's flags (see tests/capture/test_sglang_fusion.py)."""
    _serves_until_ctrl_c(tmp_path, "fusion_off", "--capture-dir", str(tmp_path / "cap"), *CAPTURE)


def test_a_fusion_without_capture_serves_on(tmp_path):
    _serves_until_ctrl_c(tmp_path, "fusion")
