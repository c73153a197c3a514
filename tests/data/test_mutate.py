"""Planted bugs: each kind on hand-written code, and on real standard-library units every chosen change is one
token on one line, parses, and changes the program."""

from __future__ import annotations

import ast
import random

import pytest

from hstap.data.code import stdlib_units
from hstap.data.mutate import apply, changes_program, choose_mutation, mutation_sites

CODE = '''def clamp(x, lo=0, hi=10):
    """Keep x in [lo, hi]."""
    if x < lo and not quiet:
        return lo
    if x in banned or x is None:
        return x + 1
    return True  # f"{x < 3}" is left alone
'''


def _changes(code: str) -> set[tuple[str, str, str]]:
    return {(s.kind, s.old, s.new) for s in mutation_sites(code)}


def test_every_kind_on_hand_written_code():
    assert _changes(CODE) == {
        ("off_by_one", "0", "1"), ("off_by_one", "10", "11"), ("comparison", "<", "<="),
        ("boolean", "and", "or"), ("not_removed", "not", ""), ("comparison", "in", "not in"),
        ("boolean", "or", "and"), ("comparison", "is", "is not"), ("arithmetic", "+", "-"),
        ("off_by_one", "1", "2"), ("bool_literal", "True", "False")}


@pytest.mark.parametrize("code,kind,expected", [
    ("y = a <= b\n", "comparison", "y = a < b\n"),
    ("y = a not in b\n", "comparison", "y = a in b\n"),
    ("y = a is not None\n", "comparison", "y = a is None\n"),
    ("y = (a -\n     b)\n", "arithmetic", "y = (a +\n     b)\n"),
    ("y = 'é' + s[1]\n", "off_by_one", "y = 'é' + s[2]\n"),  # columns are UTF-8 bytes: é takes two
    ("y = f'{a < b}'\n", None, None),
])
def test_single_sites(code, kind, expected):
    sites = [s for s in mutation_sites(code) if s.kind == kind]
    if expected is None:
        assert mutation_sites(code) == []
        return
    assert len(sites) == 1 and apply(code, sites[0]) == expected
    assert sites[0].line == 1 and sites[0].description.startswith("line 1: `")


def test_choice_is_deterministic_and_spreads_over_kinds():
    picks = [choose_mutation(CODE, random.Random(f"s{k}")) for k in range(60)]
    assert picks[:5] == [choose_mutation(CODE, random.Random(f"s{k}")) for k in range(5)]
    assert {p.kind for p in picks} == {s.kind for s in mutation_sites(CODE)}
    assert choose_mutation("x = y\n", random.Random(0)) is None


def test_real_units_change_one_line_and_the_program():
    units = stdlib_units(packages=("json", "textwrap", "email"))
    checked = 0
    for unit in units[::3]:
        tree = ast.parse(unit.code)
        for site in mutation_sites(unit.code):
            assert changes_program(unit.code, tree, site), f"{unit.key}: {site}"
            before, after = unit.code.splitlines(), apply(unit.code, site).splitlines()
            differ = [k + 1 for k, (a, b) in enumerate(zip(before, after)) if a != b]
            assert len(before) == len(after) and differ == [site.line], f"{unit.key}: {site}"
            checked += 1
    assert checked > 400
