"""bench/scaling.py: the log2 fit, its inverse, and the committed scaling data (no model, no torch work)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.bench_scripts import bench_script

ROOT = Path(__file__).resolve().parents[1]


def _scaling():
    return bench_script("scaling")


def test_the_fit_recovers_a_line_in_log2_tokens_and_tokens_for_inverts_it():
    s = _scaling()
    tokens = [10e6, 25e6, 60e6, 130e6, 400e6]
    f = s.fit(tokens, [1.5 + 0.4 * math.log2(t) for t in tokens])
    assert math.isclose(f.a, 1.5, abs_tol=1e-9) and math.isclose(f.b, 0.4, abs_tol=1e-12)
    assert math.isclose(f.r2, 1.0, abs_tol=1e-12)
    for t in tokens + [3e9]:
        assert math.isclose(s.tokens_for(f, 1.5 + 0.4 * math.log2(t)), t, rel_tol=1e-9)
    assert s.tokens_for(s.Fit(a=2.0, b=0.0, r2=math.nan, n=2), 3.0) == math.inf


def test_the_committed_data_loads_sorted_with_every_tau_above_one():
    s = _scaling()
    rows = s.load(ROOT / "docs" / "logs" / "scaling.json")
    shipped = [r["tokens_trained"] for r in rows if r["chain"] == "shipped"]
    assert len(shipped) >= 4 and shipped == sorted(shipped)
    assert [r["tokens_trained"] for r in rows] == sorted(r["tokens_trained"] for r in rows)
    for r in rows:
        assert r["tau"] and set(r["tau"]) <= set(s.METHODS), r["run"]
        assert all(tau > 1 for tau in r["tau"].values()), r["run"]
    assert s.fit_method([r for r in rows if r["chain"] == "shipped"], "chain:3").b > 0
