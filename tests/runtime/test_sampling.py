"""The speculative-sampling acceptance rule leaves the target's distribution unchanged (chi-square over 5 tokens,
20,000 trials each), and the same test rejects broken rules, so it has the power to notice a mistake."""

from __future__ import annotations

import math

import torch

from hstap.runtime.sampling import choose_child, residual, sample

P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])  # target
Q = torch.tensor([0.10, 0.05, 0.30, 0.25, 0.30])  # draft: over-proposes the tail
Q_NO_FIRST = torch.tensor([0.0, 0.3, 0.3, 0.2, 0.2])  # draft vocabulary without token 0
TRIALS = 20_000


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_LIMIT = 18.47  # chi-square(4 degrees of freedom), upper 0.1 % point


def run(propose, rule=choose_child, p: torch.Tensor = P, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Output histogram and acceptance rate of `rule` with candidates from `propose(generator)`."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(5)
    accepted = 0
    for _ in range(TRIALS):
        tokens, proposals = propose(g)
        index, rest = rule(p, tokens, proposals, g)
        counts[tokens[index] if index is not None else sample(rest, g)] += 1
        accepted += index is not None
    return counts, accepted / TRIALS


def test_single_sampled_draft_keeps_target_distribution():
    counts, rate = run(lambda g: ([sample(Q, g)], [Q]))
    assert chi2(counts, P) < CHI2_LIMIT
    assert abs(rate - float(torch.minimum(P, Q).sum())) < 0.015  # acceptance = Σ min(p, q) = 0.55


def test_draft_vocab_missing_a_token_keeps_target_distribution():
    counts, _ = run(lambda g: ([sample(Q_NO_FIRST, g)], [Q_NO_FIRST]))
    assert chi2(counts, P) < CHI2_LIMIT  # token 0 is only reachable through the residual


def test_deterministic_siblings_keep_target_distribution():
    counts, rate = run(lambda g: ([3, 0], [None, None]))  # EAGLE-2 top-k children: point masses
    assert chi2(counts, P) < CHI2_LIMIT
    assert abs(rate - 0.5) < 0.015  # p(3) + p(0) = 0.5


def test_independent_sampled_siblings_keep_target_distribution():
    counts, _ = run(lambda g: ([sample(Q, g), sample(Q, g)], [Q, Q]))
    assert chi2(counts, P) < CHI2_LIMIT


def test_broken_rules_are_detected():
    def always_accept(p, tokens, proposals, g):
        return 0, p

    def resample_from_target(p, tokens, proposals, g):  # rejection without the residual
        index, _ = choose_child(p, tokens, proposals, g)
        return index, p

    for rule in (always_accept, resample_from_target):
        counts, _ = run(lambda g: ([sample(Q, g)], [Q]), rule=rule)
        assert chi2(counts, P) > 10 * CHI2_LIMIT, rule.__name__


def test_residual():
    r = residual(P, Q)
    assert torch.allclose(r, torch.tensor([0.30, 0.20, 0.0, 0.0, 0.0]) / 0.5)
    assert torch.equal(residual(P, P), P)  # nothing left: fall back rather than divide by zero
    assert math.isclose(float(r.sum()), 1.0, rel_tol=1e-6)
