"""hstap/metrics.py's τ intervals (bench/spec_decode.py's comparison of two logs: lab/tests)."""

from __future__ import annotations

import random

import pytest

from hstap.metrics import acceptance_length, tau_difference_interval, tau_interval


def _prompts(seed: int, n: int = 60) -> list[tuple[int, int]]:
    """(generated tokens, verification forwards) of n prompts of uneven difficulty (τ 1.5 to 4.5)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        forwards = rng.randrange(40, 160)
        out.append((int(forwards * rng.uniform(1.5, 4.5)), forwards))
    return out


def test_the_interval_holds_tau_and_narrows_to_nothing_when_every_prompt_agrees():
    pairs = _prompts(0)
    tau = acceptance_length(sum(e for e, _ in pairs), sum(f for _, f in pairs))
    lo, hi = tau_interval(pairs)
    assert lo < tau < hi and 0.1 < hi - lo < 1.0
    assert tau_interval(pairs) == (lo, hi)  # seeded: the same interval every time
    assert tau_interval([(3 * f, f) for _, f in pairs]) == (3.0, 3.0)


def test_a_paired_difference_sees_a_small_shift_that_unpaired_intervals_overlap():
    first = _prompts(1)
    second = [(e + f // 10, f) for e, f in first]  # every prompt +0.1 τ: far less than the prompts' spread
    lo, hi = tau_difference_interval(second, first)
    assert 0.0 < lo <= hi < 0.2
    assert tau_interval(second)[0] < tau_interval(first)[1]  # on their own the two intervals overlap
    assert tau_difference_interval(first, first) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same, non-empty"):
        tau_difference_interval(first, first[:-1])
