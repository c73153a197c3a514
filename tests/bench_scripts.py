"""The bench/ scripts as modules, for the tests of their logic (bench/ is not a package)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@functools.cache
def bench_script(name: str) -> ModuleType:
    """bench/NAME.py, loaded once per test process and registered in sys.modules (dataclasses resolve the module's
    string annotations through it). bench/ goes on sys.path first, as it is for a script run from there (one
    script imports another's helpers)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
