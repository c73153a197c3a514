"""The metrics every stage reports, each defined in exactly one place so stages cannot drift."""

from __future__ import annotations

import random


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput; 0 when no time has passed (a first progress update)."""
    return tokens / seconds if seconds > 0 else 0.0


def acceptance_length(generated_tokens: int, verify_forwards: int) -> float:
    """τ: tokens generated per target verification forward, the bonus token included (so τ ≥ 1)."""
    if verify_forwards <= 0:
        raise ValueError("acceptance_length needs at least one verification forward")
    return generated_tokens / verify_forwards


def tau_interval(pairs: list[tuple[int, int]], level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of τ over prompts, from each prompt's (generated tokens, verification
    forwards): how far τ could move on another draw of prompts like these. On MT-bench's 80 questions a big tree's
    τ of about 4.2 spans about half a token (docs/benchmarks.md), so a goal 0.3 away is not reached or missed by one
    run's second decimal."""
    return tau_difference_interval(pairs, None, level, resamples, seed)


def tau_difference_interval(pairs: list[tuple[int, int]], others: list[tuple[int, int]] | None,
                            level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of τ(pairs) − τ(others) over the same prompts in the same order
    (others None: of τ(pairs) alone). Resampling a prompt takes it in both runs, so what the prompts have in
    common (their difficulty) cancels and only the runs' difference is left."""
    if not pairs or (others is not None and len(others) != len(pairs)):
        raise ValueError("tau intervals need the same, non-empty list of prompts on both sides")
    rng, n, values = random.Random(seed), len(pairs), []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        value = acceptance_length(sum(pairs[i][0] for i in picks), sum(pairs[i][1] for i in picks))
        if others is not None:
            value -= acceptance_length(sum(others[i][0] for i in picks), sum(others[i][1] for i in picks))
        values.append(value)
    values.sort()
    tail = (1 - level) / 2
    return values[int(tail * (resamples - 1))], values[int(round((1 - tail) * (resamples - 1)))]
