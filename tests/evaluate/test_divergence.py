"""Where a greedy shape's answer leaves vanilla's (hstap.evaluate.divergence): rounding steps per dtype, the margin
of two chosen tokens, and `evaluate_shapes` on a forced near tie — two tokens whose logits are equal, picked one
way by vanilla and the other by verification that rounds a step the other way — reported within rounding, while
a verification that picks a far-behind token is reported as a wide margin and fails the greedy identity check."""

from __future__ import annotations

import math

import pytest
import torch

from hstap.evaluate.divergence import WITHIN_ROUNDING_ULPS, first_difference, margin, rounding_step
from hstap.evaluate.results import Prompt
from hstap.evaluate.run import evaluate_shapes
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from tests.evaluate.tiny import tiny_drafter, tiny_target
from tests.runtime.conftest import assert_greedy_identity


def test_rounding_step_is_the_spacing_of_the_dtype_at_that_magnitude():
    assert rounding_step(20.0, torch.float32) == 2.0 ** -19  # eps 2⁻²³ · 16
    assert rounding_step(-20.0, torch.bfloat16) == 0.125  # eps 2⁻⁷ · 16
    assert rounding_step(1.0, torch.float16) == 2.0 ** -10
    for dtype in (torch.float32, torch.bfloat16):  # the step is the gap to the next number of that dtype
        x = torch.tensor(13.7, dtype=dtype)
        assert float(torch.nextafter(x, torch.tensor(math.inf, dtype=dtype)) - x) == rounding_step(13.7, dtype)
    assert rounding_step(0.0, torch.float32) == torch.finfo(torch.float32).eps * 2.0 ** -126  # the smallest normal's


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2  # one answer stopped where the other went on


def test_margin_in_rounding_steps():
    logits = torch.tensor([3.0, 2.0, float(torch.nextafter(torch.tensor(3.0), torch.tensor(0.0))), -1.0])
    assert margin(logits, 0, 2, torch.float32) == (1.0, True, True)  # the top two, one step apart
    ulps, top_two, within = margin(logits, 0, 1, torch.float32)  # a whole logit: 2²² steps of 2⁻²²
    assert ulps == 2.0 ** 22 and not top_two and not within
    step = 0.0625  # bf16's spacing in [8, 16)
    bf16 = torch.tensor([15.0, 15.0 - WITHIN_ROUNDING_ULPS[torch.bfloat16] * step, 0.0])
    assert margin(bf16, 0, 1, torch.bfloat16) == (WITHIN_ROUNDING_ULPS[torch.bfloat16], True, True)
    wider = bf16.clone()
    wider[1] -= step
    assert margin(wider, 0, 1, torch.bfloat16)[2] is False


@pytest.fixture(scope="module")
def tied():
    """The tiny Llama with tokens 1 and 2 tied exactly (the same lm_head row) and token 0 their opposite: where
    the tie leads, vanilla decoding takes token 1 (argmax keeps the first of equal logits)."""
    target = tiny_target(seed=4)
    with torch.no_grad():
        head = target.lm_head.weight  # (3, H)
        head[2] = head[1]
        head[0] = -head[1]
    return target, tiny_drafter(target)


def verification_bumps(monkeypatch, token: int, amount: float | None) -> None:
    """Greedy acceptance sees `token`'s logit raised by `amount`, or by one rounding step when None: what a
    verification forward that rounds differently from the one-token step does to a tie."""
    real = SpecDecoder._accept_greedy

    def bumped(self, st, slot, logits, aux):
        logits = logits.clone()  # (B, 1+N, V)
        column = logits[..., token]
        logits[..., token] = torch.nextafter(column, torch.full_like(column, math.inf)) if amount is None \
            else column + amount
        return real(self, st, slot, logits, aux)

    monkeypatch.setattr(SpecDecoder, "_accept_greedy", bumped)


def evaluate_tied(tied, prompts):
    target, drafter = tied
    return evaluate_shapes(target, drafter, prompts, [DraftShape.parse("chain:2")], 12, set(), warmup=0,
                           progress=False)


PROMPTS = [Prompt("a", [0, 1, 2, 1, 0]), Prompt("b", [2, 2, 1, 0]), Prompt("c", [1, 0, 0, 2, 1, 2])]


def test_a_forced_near_tie_is_reported_within_rounding(tied, monkeypatch):
    verification_bumps(monkeypatch, 2, None)  # token 2 wins the tie by one step in verification
    vanilla, (chain,) = evaluate_tied(tied, PROMPTS)
    assert chain.divergences, "the tie led somewhere in these answers"
    for d in chain.divergences:
        v, g = vanilla.generations[[p.id for p in PROMPTS].index(d.prompt)], \
            chain.generations[[p.id for p in PROMPTS].index(d.prompt)]
        assert v.tokens[: d.position] == g.tokens[: d.position] and v.tokens[d.position] != g.tokens[d.position]
        assert (d.vanilla_token, d.shape_token) == (1, 2)
        assert d.top_two and d.within_rounding and d.margin_ulps <= 1.0  # equal rows: equal logits, or a step
    runtime = tied_runtime(tied)
    for p, v, g in zip(PROMPTS, vanilla.generations, chain.generations):
        assert_greedy_identity(runtime, p.ids, v.tokens, g.tokens, "chain:2")  # rounding: passes


def test_a_wide_margin_is_not_rounding_and_fails_greedy_identity(tied, monkeypatch):
    verification_bumps(monkeypatch, 0, 100.0)  # verification prefers token 0, far behind wherever 1 and 2 lead
    vanilla, (chain,) = evaluate_tied(tied, PROMPTS)
    assert chain.divergences
    for d in chain.divergences:
        assert (d.vanilla_token, d.shape_token) == (1, 0)
        assert not d.top_two and not d.within_rounding and d.margin_ulps > WITHIN_ROUNDING_ULPS[torch.float32]
    p = next(p for p in PROMPTS if p.id == chain.divergences[0].prompt)
    k = PROMPTS.index(p)
    with pytest.raises(AssertionError, match=r"chain:2 left the reference at token \d+: .* not rounding"):
        assert_greedy_identity(tied_runtime(tied), p.ids, vanilla.generations[k].tokens,
                               chain.generations[k].tokens, "chain:2")


def tied_runtime(tied):
    from hstap.runtime.target import Runtime

    return Runtime(tied[0], batch_size=1, max_len=64)
