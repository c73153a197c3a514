"""The code source on the real standard library: units that parse alone, skips counted, a stable order."""

from __future__ import annotations

import ast

import pytest

from hstap.data import SkipReport
from hstap.data.code import python_files, stdlib_dir, stdlib_units
from hstap.errors import HstapError

PACKAGES = ("json", "textwrap", "email", "unittest")


@pytest.fixture(scope="module")
def units():
    report = SkipReport()
    return stdlib_units(packages=PACKAGES, report=report), report


def test_units_parse_alone_and_respect_the_bounds(units):
    found, report = units
    assert len(found) > 250
    assert {u.kind for u in found} == {"function", "method", "class"}
    assert {u.module.split(".")[0] for u in found} == set(PACKAGES)
    for unit in found:
        node = ast.parse(unit.code).body[0]
        assert node.name == unit.name and not unit.name.startswith("_")
        assert len(unit.code) <= 2500 and not unit.code.startswith((" ", "\t"))
    assert len({u.key for u in found}) == len(found)
    same_module = [(a, b) for a, b in zip(found, found[1:]) if a.module == b.module]
    assert all(a.lineno < b.lineno for a, b in same_module), "file order, then line order"


def test_skips_are_counted(units):
    found, report = units
    assert set(report.counts) <= {"test_file", "unparsable_file", "private", "too_short", "too_long",
                                  "not_standalone", "duplicate_code"}
    assert report.counts["test_file"] > 20, "unittest's own test package is left out"
    assert report.counts["private"] > 0 and report.counts["too_short"] > 0
    assert not any("/test" in u.module.replace(".", "/") for u in found)


def test_docstring_lines_do_not_count(tmp_path):
    (tmp_path / "os.py").write_text("")
    (tmp_path / "m.py").write_text('def long_doc(x):\n    """One.\n\n    Two.\n    Three.\n    """\n    return x\n\n'
                                    "def real(x):\n    a = x\n    b = a + 1\n    c = b * 2\n    return c\n")
    report = SkipReport()
    found = stdlib_units(root=tmp_path, min_lines=5, report=report)
    assert [u.qualname for u in found] == ["real"] and report.counts == {"too_short": 1}


def test_duplicates_ignore_docstrings_and_comments(tmp_path):
    body = "    a = x\n    b = a + 1  # {}\n    return b * 2\n"
    (tmp_path / "a.py").write_text("def f(x):\n" + body.format("one") + "\ndef g(x):\n    '''doc'''\n"
                                   + body.format("two"))
    report = SkipReport()
    found = stdlib_units(root=tmp_path, min_lines=3, report=report)
    assert [u.qualname for u in found] == ["f"] and report.counts == {"duplicate_code": 1}


def test_the_whole_stdlib_is_walked_without_site_packages():
    root = stdlib_dir()
    files = python_files(root, SkipReport(), ("json",))
    assert files and all(p.relative_to(root).parts[0] == "json" for p in files)
    assert not any("site-packages" in p.parts for p in python_files(root, SkipReport(), ("email",)))


def test_bad_roots_and_packages_are_one_line_errors(tmp_path):
    with pytest.raises(HstapError, match="not a directory"):
        stdlib_units(root=tmp_path / "nope")
    with pytest.raises(HstapError, match=r"code package 'nosuchpkg' \(--code-package\) is not a module or package of"):
        stdlib_units(packages=("nosuchpkg",))
