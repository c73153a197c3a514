"""bench/spec_decode.py's paired comparison of two logs (`--compare A.jsonl B.jsonl`): prompts matched by id, τ of
the second minus the first with a paired interval, and the wall time per cycle of both."""

from __future__ import annotations

import random

import spec_decode


def _prompts(seed: int, n: int = 60) -> list[tuple[int, int]]:
    """(generated tokens, verification forwards) of n prompts of uneven difficulty (τ 1.5 to 4.5)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        forwards = rng.randrange(40, 160)
        out.append((int(forwards * rng.uniform(1.5, 4.5)), forwards))
    return out


def test_spec_decode_compare_pairs_the_logs_by_prompt_id():
    def log(shift: int) -> list[dict]:
        return [{"id": f"q{i}", "batch": 1,
                 "methods": {"vanilla": {"emitted": f, "verify_forwards": f, "seconds": f / 500, "cycles": f},
                             "chain:3": {"emitted": e + shift, "verify_forwards": f, "seconds": f / 400 + shift / 1e3,
                                         "cycles": f}}}
                for i, (e, f) in enumerate(_prompts(2, 20))]

    first, second = log(0), log(0)[::-1]  # the same prompts in another order: no difference
    assert "| chain:3 | " in (text := spec_decode.compare(first, second)) and "+0.000 | +0.000 to +0.000 |" in text
    shifted = spec_decode.compare(first, log(30)[:10])  # 30 more tokens on each of half the prompts
    assert shifted.startswith("10 prompts in both logs")
    tau_row = next(line for line in shifted.splitlines() if line.startswith("| chain:3 | "))
    low = float(tau_row.split("|")[5].split(" to ")[0])
    assert low > 0  # the interval leaves 0 out
    # and the wall time per cycle of both logs on the same prompts: 2 ms a vanilla step, 2.5 ms a chain cycle
    assert "| vanilla | 2.000 | 2.000 | +0.000 |" in text and "| chain:3 | 2.500 | 2.500 | +0.000 |" in text
