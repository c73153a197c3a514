"""Triton kernels checked on a CPU: a check script run in a child process with TRITON_INTERPRET=1, which Triton
reads when it is first imported (this process may have imported it already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(script: Path, last_line: str) -> None:
    """Run `script` under Triton's interpreter; it must exit 0 and end by printing `last_line`."""
    pytest.importorskip("triton")  # installed by make test (requirements-engines.txt); CUDA torch ships it
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith(last_line)
