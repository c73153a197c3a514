"""Code requests from real stdlib units: deterministic by seed, well formed, spread over units, real planted bugs."""

from __future__ import annotations

import ast
import re

import pytest

from hstap.data import SkipReport
from hstap.data.checks import message_problem
from hstap.data.code import stdlib_units
from hstap.data.code_tasks import TASKS, code_requests, eligible_tasks, planted_bug
from hstap.data.mutate import apply

FENCE = re.compile(r"\A(?P<prose>[^\n]+)\n\n```python\n(?P<code>.*)\n```\Z", re.S)


@pytest.fixture(scope="module")
def units():
    return stdlib_units(packages=("json", "textwrap", "email"))


@pytest.fixture(scope="module")
def requests(units):
    report = SkipReport()
    return list(code_requests(units, seed=0, report=report)), report


def test_same_seed_same_requests_other_seed_other_order(units, requests):
    again = list(code_requests(units, seed=0))
    assert [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in requests[0]]
    other = [c.id for c in code_requests(units, seed=1)]
    assert other != [c.id for c in requests[0]] and sorted(other) != sorted(c.id for c in requests[0])


def test_requests_are_well_formed(units, requests):
    convs, report = requests
    assert len({c.id for c in convs}) == len(convs)
    by_key = {u.key: u for u in units}
    for conv in convs:
        assert message_problem(conv.messages) is None and len(conv.messages) == 1
        match = FENCE.match(conv.messages[0]["content"])
        assert match, conv.messages[0]["content"][:200]
        unit = by_key[conv.meta["unit"]]
        task = conv.meta["category"]
        assert conv.id == f"code-{unit.key}-{task}" and task in eligible_tasks(unit, 0)
        assert f"`{unit.module}`" in match["prose"] or unit.name in match["prose"]
        if task not in ("complete", "fix_bug"):
            assert match["code"] == unit.code.rstrip()
    assert set(report.counts) <= {"near_duplicate_code"}
    kept_units = len(units) - report.counts.get("near_duplicate_code", 0)
    assert len(convs) == sum(len(eligible_tasks(u, 0)) for u in units if u.key in {c.meta["unit"] for c in convs})
    assert {c.meta["unit"] for c in convs[:kept_units]} == {c.meta["unit"] for c in convs}, "first pass: one each"


def test_tasks_are_spread_and_capped(units, requests):
    convs = requests[0]
    assert {c.meta["category"] for c in convs} == set(TASKS)
    capped = list(code_requests(units, seed=0, tasks_per_unit=2))
    per_unit: dict[str, int] = {}
    for c in capped:
        per_unit[c.meta["unit"]] = per_unit.get(c.meta["unit"], 0) + 1
    assert max(per_unit.values()) == 2 and len(capped) < len(convs)


def test_complete_cuts_the_body(units, requests):
    by_key = {u.key: u for u in units}
    completes = [c for c in requests[0] if c.meta["category"] == "complete"]
    assert len(completes) > 20
    for conv in completes:
        code = FENCE.match(conv.messages[0]["content"])["code"]
        unit = by_key[conv.meta["unit"]]
        assert unit.code.startswith(code) and len(code) < len(unit.code.rstrip())
        ast.parse(code)  # cut after a whole statement: what is left parses


def test_fix_bug_plants_the_described_change(units, requests):
    by_key = {u.key: u for u in units}
    bugs = [c for c in requests[0] if c.meta["category"] == "fix_bug"]
    assert len(bugs) > 50 and len({c.meta["bug_kind"] for c in bugs}) == 6
    for conv in bugs:
        unit = by_key[conv.meta["unit"]]
        code = FENCE.match(conv.messages[0]["content"])["code"]
        site = planted_bug(unit, 0)
        assert code == apply(unit.code, site).rstrip() and conv.meta["bug"] == site.description
        assert ast.dump(ast.parse(code)) != ast.dump(ast.parse(unit.code)), "the bug really changes the program"
        line = int(re.match(r"line (\d+):", conv.meta["bug"])[1])
        assert code.splitlines()[line - 1] != unit.code.splitlines()[line - 1]
