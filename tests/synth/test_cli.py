"""`hstap synth` as a process: SIGKILL mid-run leaves only whole lines, and a re-run completes the exact set."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from tests.synth.conftest import ENV, ROOT, SHORT_QUESTIONS


def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def test_sigkill_mid_run_then_resume_is_exact(tmp_path, short_prompts, healthy_server):
    """Each run SIGKILLs itself right after its n-th whole record (HSTAP_FAULT, no timer), with other requests
    still in flight: the file holds only whole lines, and a re-run completes the exact set."""
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "hstap.cli", "synth", "--server", healthy_server[0], "--data",
           f"jsonl:{short_prompts}", "--out", str(out), "--max-new-tokens", "8", "--concurrency", "2"]
    written = 0
    for kill_after in (2, 4):
        proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, "HSTAP_FAULT": f"record-written:{kill_after}"},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        written += kill_after
        text = out.read_text(encoding="utf-8")
        assert text.endswith("\n"), "no partial line"
        ids = [json.loads(line)["id"] for line in text.splitlines()]  # every line is a whole JSON record
        assert len(ids) == len(set(ids)) == written
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed past" in done.stdout
    ids = [json.loads(line)["id"] for line in _lines(out)]
    assert sorted(ids) == [f"q{k:02d}" for k in range(len(SHORT_QUESTIONS))], "exact set, no duplicates"
