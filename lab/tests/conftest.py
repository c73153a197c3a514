"""The lab's tests (`make lab-test`; `make test` never collects them): they import the scripts of bench/ and lab/
as modules, as a script run from either folder finds its neighbours (neither folder is a package)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "bench", ROOT / "lab"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
