"""The metrics every stage reports, each defined in exactly one place so stages cannot drift."""

from __future__ import annotations


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput; 0 when no time has passed (a first progress update)."""
    return tokens / seconds if seconds > 0 else 0.0


def acceptance_length(generated_tokens: int, verify_forwards: int) -> float:
    """τ: tokens generated per target verification forward, the bonus token included (so τ ≥ 1)."""
    if verify_forwards <= 0:
        raise ValueError("acceptance_length needs at least one verification forward")
    return generated_tokens / verify_forwards
