"""Functions and classes of Python's standard library, read with `ast`: real code present on every machine.

    from hstap.data import SkipReport
    from hstap.data.code import stdlib_units
    report = SkipReport()
    units = stdlib_units(report=report)    # CodeUnit(module, qualname, lineno, kind, code), sorted by file and line
    print(len(units), report.summary())     # Python 3.11: 734 files, ~5,000 units kept

A unit is a top-level function, a top-level class, or a method of a top-level class, with its decorators, dedented
so that it parses on its own. Skipped, and counted: files of test packages (`test_file`), files that do not parse
(`unparsable_file`), names starting with `_` (`private`: helpers and dunders say little on their own), units that
stop parsing once dedented (`not_standalone`: a multi-line string at column 0), units under `min_lines` lines of
code (`too_short`: its own docstring not counted) or over `max_lines` / `max_chars` (`too_long`), and repeats of
code already kept (`duplicate_code`, compared without comments, docstrings, formatting or the unit's own name).
`site-packages` is not the standard library and is never read.
hstap/data/code_tasks.py turns units into requests.
"""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hstap.data.config import CODE_MAX_LINES, CODE_MIN_LINES
from hstap.data.types import SkipReport
from hstap.errors import HstapError

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CodeUnit:
    """One function, method or class: `code` is its dedented source, decorators included."""

    module: str  # "json.decoder"
    qualname: str  # "JSONDecoder.raw_decode"
    lineno: int  # where it starts in its file (1-based, decorators included)
    kind: Literal["function", "method", "class"]
    code: str

    @property
    def key(self) -> str:
        """Unique within one standard library (a module can define the same name twice)."""
        return f"{self.module}.{self.qualname}@{self.lineno}"

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def stdlib_dir() -> Path:
    """The running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`)."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not (path / "os.py").is_file():
        raise HstapError(f"{path}: not a Python standard library (no os.py): the code source needs the .py files")
    return path


def stdlib_units(root: Path | None = None, min_lines: int = CODE_MIN_LINES, max_lines: int = CODE_MAX_LINES,
                 max_chars: int = 2500, packages: tuple[str, ...] = (),
                 report: SkipReport | None = None) -> list[CodeUnit]:
    """Every usable unit under `root` (default: this interpreter's stdlib), in file then line order.

    `packages`: only these top-level modules or packages (`("json", "textwrap")`), all when empty. The walk is
    cached per arguments (parsing ~700 files takes seconds); skip counts are added to `report`."""
    units, counts = _cached_units(str(root or stdlib_dir()), min_lines, max_lines, max_chars, tuple(packages))
    if report is not None:
        for reason, n in counts:
            report.add(reason, n)
    return list(units)


@functools.lru_cache(maxsize=4)
def _cached_units(root: str, min_lines: int, max_lines: int, max_chars: int,
                  packages: tuple[str, ...]) -> tuple[tuple[CodeUnit, ...], tuple[tuple[str, int], ...]]:
    report = SkipReport()
    units: list[CodeUnit] = []
    seen: set[str] = set()
    for path in python_files(Path(root), report, packages):
        module = _module_name(path, Path(root))
        for unit in _file_units(path, module, report):
            reason = _unit_problem(unit, min_lines, max_lines, max_chars, seen)
            if reason is not None:
                report.add(reason)
                continue
            units.append(unit)
    return tuple(units), tuple(sorted(report.counts.items()))


def python_files(root: Path, report: SkipReport, packages: tuple[str, ...] = ()) -> list[Path]:
    """The .py files under `root` (of `packages` only, if given), sorted; files of test packages are counted
    `test_file` and left out."""
    if not root.is_dir():
        raise HstapError(f"{root}: not a directory (expected a Python standard library)")
    missing = [p for p in packages if not ((root / p).is_dir() or (root / f"{p}.py").is_file())]
    if missing:
        raise HstapError(f"code package {missing[0]!r} (--code-package) is not a module or package of {root}")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        dirnames[:] = sorted(d for d in dirnames if d not in NOT_STDLIB and (rel or not packages or d in packages))
        in_tests = bool(TEST_DIRS & set(rel))
        for name in sorted(filenames):
            if not name.endswith(".py") or (packages and not rel and name[:-3] not in packages):
                continue
            if in_tests or name.startswith("test_") or name.endswith("_test.py"):
                report.add("test_file")
                continue
            files.append(Path(dirpath) / name)
    return sorted(files)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _file_units(path: Path, module: str, report: SkipReport) -> list[CodeUnit]:
    try:
        with tokenize.open(path) as f:  # honours the file's encoding cookie
            text = f.read()
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        report.add("unparsable_file")
        return []
    lines = text.splitlines()
    units = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            units.append(_unit(node, lines, module, node.name, "function"))
        elif isinstance(node, ast.ClassDef):
            units.append(_unit(node, lines, module, node.name, "class"))
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    units.append(_unit(child, lines, module, f"{node.name}.{child.name}", "method"))
    return units


def _unit(node: ast.AST, lines: list[str], module: str, qualname: str, kind: str) -> CodeUnit:
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    code = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
    return CodeUnit(module=module, qualname=qualname, lineno=start, kind=kind, code=code)


def _unit_problem(unit: CodeUnit, min_lines: int, max_lines: int, max_chars: int, seen: set[str]) -> str | None:
    """The skip reason of `unit`, or None; a kept unit's normalised code joins `seen`."""
    if any(part.startswith("_") for part in unit.qualname.split(".")):
        return "private"
    if len(unit.code) > max_chars:
        return "too_long"
    try:
        tree = ast.parse(unit.code)
    except SyntaxError:
        return "not_standalone"
    n_lines = code_lines(unit.code, tree)
    if n_lines < min_lines:
        return "too_short"
    if n_lines > max_lines:
        return "too_long"
    tree.body[0].name = "_"  # the same code under another name (an alias kept for compatibility) is a repeat
    key = ast.dump(_without_docstrings(tree))
    if key in seen:
        return "duplicate_code"
    seen.add(key)
    return None


def code_lines(code: str, tree: ast.Module) -> int:
    """Non-blank lines outside the unit's own docstring: `def f(): "long doc"; return True` is a one-liner."""
    doc: set[int] = set()
    node = tree.body[0]
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        doc = set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(1 for k, line in enumerate(code.splitlines(), start=1) if line.strip() and k not in doc)


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """The tree with every docstring removed: two copies of a function that differ only there are one function."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree
