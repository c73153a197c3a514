"""lab/scaling.py: the log2 fit, its inverse, and the committed scaling data (no model, no torch work)."""

from __future__ import annotations

import math
from pathlib import Path

import scaling

LAB = Path(__file__).resolve().parents[1]


def test_the_fit_recovers_a_line_in_log2_tokens_and_tokens_for_inverts_it():
    tokens = [10e6, 25e6, 60e6, 130e6, 400e6]
    f = scaling.fit(tokens, [1.5 + 0.4 * math.log2(t) for t in tokens])
    assert math.isclose(f.a, 1.5, abs_tol=1e-9) and math.isclose(f.b, 0.4, abs_tol=1e-12)
    assert math.isclose(f.r2, 1.0, abs_tol=1e-12)
    for t in tokens + [3e9]:
        assert math.isclose(scaling.tokens_for(f, 1.5 + 0.4 * math.log2(t)), t, rel_tol=1e-9)
    assert scaling.tokens_for(scaling.Fit(a=2.0, b=0.0, r2=math.nan, n=2), 3.0) == math.inf


def test_the_committed_data_loads_sorted_with_every_tau_above_one():
    rows = scaling.load(LAB / "logs" / "scaling.json")
    shipped = [r["tokens_trained"] for r in rows if r["chain"] == "shipped"]
    assert len(shipped) >= 4 and shipped == sorted(shipped)
    assert [r["tokens_trained"] for r in rows] == sorted(r["tokens_trained"] for r in rows)
    for r in rows:
        assert r["tau"] and set(r["tau"]) <= set(scaling.METHODS), r["run"]
        assert all(tau > 1 for tau in r["tau"].values()), r["run"]
    assert scaling.fit_method([r for r in rows if r["chain"] == "shipped"], "chain:3").b > 0
