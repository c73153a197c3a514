"""Shared by the crash loops of synth and train (tests/synth/test_crash_loops.py, tests/train/test_crash_loops.py):
run `hstap` as a process (optionally under HSTAP_FAULT), record figures, mount a small disk.

The loops run only with HSTAP_RELIABILITY_LOOPS=1 (minutes each); with HSTAP_RELIABILITY_OUT=FILE.json their
figures are collected there (docs/reliability-train.md quotes them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOPS = os.environ.get("HSTAP_RELIABILITY_LOOPS") == "1"
needs_loops = pytest.mark.skipif(not LOOPS, reason="crash loops run with HSTAP_RELIABILITY_LOOPS=1 (minutes)")
TRIALS, SEED = 20, 13
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def hstap(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """`python -m hstap.cli ARGS` in the repository root, with HSTAP_FAULT=`fault` if given."""
    env = {**ENV, "HSTAP_FAULT": fault} if fault else ENV
    return subprocess.run([sys.executable, "-m", "hstap.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def record(name: str, result: dict) -> None:
    """Print `result` and merge it into $HSTAP_RELIABILITY_OUT under `name`."""
    print(f"\n{name}: {json.dumps(result)}")
    out = os.environ.get("HSTAP_RELIABILITY_OUT")
    if out:
        path = Path(out)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, name: result}, indent=1) + "\n")


def killed(proc: subprocess.CompletedProcess) -> bool:
    """SIGKILLed by the fault; a run that finished (its point never reached) is False; anything else fails."""
    if proc.returncode == -signal.SIGKILL:
        return True
    assert proc.returncode == 0, proc.stderr[-3000:]
    return False


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line (progress bars come before it)."""
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else ""


class SmallDisk:
    """A tmpfs of `size` mounted at `path` (root only; skipped otherwise): a real full disk, then `grow` it."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")

    def grow(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", str(self.path)], check=False)
