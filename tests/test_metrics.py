"""hstap/metrics.py's τ intervals, and bench/spec_decode.py's paired comparison of two logs."""

from __future__ import annotations

import random

import pytest

from hstap.metrics import acceptance_length, tau_difference_interval, tau_interval
from tests.bench_scripts import bench_script


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


def test_spec_decode_compare_pairs_the_logs_by_prompt_id():
    bench = bench_script("spec_decode")

    def log(shift: int) -> list[dict]:
        return [{"id": f"q{i}", "batch": 1,
                 "methods": {"vanilla": {"emitted": f, "verify_forwards": f, "seconds": f / 500, "cycles": f},
                             "chain:3": {"emitted": e + shift, "verify_forwards": f, "seconds": f / 400 + shift / 1e3,
                                         "cycles": f}}}
                for i, (e, f) in enumerate(_prompts(2, 20))]

    first, second = log(0), log(0)[::-1]  # the same prompts in another order: no difference
    assert "| chain:3 | " in (text := bench.compare(first, second)) and "+0.000 | +0.000 to +0.000 |" in text
    shifted = bench.compare(first, log(30)[:10])  # 30 more tokens on each of half the prompts
    assert shifted.startswith("10 prompts in both logs")
    tau_row = next(line for line in shifted.splitlines() if line.startswith("| chain:3 | "))
    low = float(tau_row.split("|")[5].split(" to ")[0])
    assert low > 0  # the interval leaves 0 out
    # and the wall time per cycle of both logs on the same prompts: 2 ms a vanilla step, 2.5 ms a chain cycle
    assert "| vanilla | 2.000 | 2.000 | +0.000 |" in text and "| chain:3 | 2.500 | 2.500 | +0.000 |" in text
