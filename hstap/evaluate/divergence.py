"""Where a greedy draft shape's answer first differs from vanilla decoding's, and whether rounding explains it.

    div = first_divergence(runtime, prompt_ids, vanilla_tokens, shape_tokens)   # None when the answers agree
    div.position, div.margin_ulps, div.within_rounding

Greedy speculative decoding emits the target's argmax at every position, as vanilla decoding does, but it computes
the target's logits differently (a block of several tokens per forward instead of one, other kernels), so the two
round differently. Where two tokens' logits are within that rounding of each other, either computation may pick
either one, and from there the answers go their own ways. A divergence is explained by rounding when the two
tokens chosen there are the target's top two and their logits differ by at most WITHIN_ROUNDING_ULPS rounding
steps of the model's dtype at that magnitude (`rounding_step`); a wider margin means the shape computed something
other than the target's argmax: a bug.

The logits are the target's own at that position: a prefill of the prompt and the tokens both answers share, on
the runtime the methods ran on (a third computation, rounded its own way, untimed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from hstap.runtime.target import Runtime

# How far two computations of one top-2 logit gap drift apart, in rounding steps at the top logit's magnitude:
# SmolLM2-135M's greedy answers to 8 MT-bench questions, 384 positions, its one-token steps against a prefill of the
# same tokens (`python bench/logit_spread.py --prompts 8 --tokens 48`, docs/benchmarks.md):
# fp32 median 4, p90 12, max 61; bf16 median 1, p90 2, max 6. About twice the largest seen counts as rounding (fp16
# keeps bf16's: three more mantissa bits, the same few roundings per layer).
WITHIN_ROUNDING_ULPS = {torch.float32: 128.0, torch.bfloat16: 12.0, torch.float16: 12.0}


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at |value| (its ulp there): eps · 2^⌊log2|value|⌋, e.g. 2⁻¹⁹ for an fp32
    logit of 20 (eps 2⁻²³ · 16), 0.125 for a bf16 one (eps 2⁻⁷ · 16). Values below the smallest normal number
    take its spacing."""
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


@dataclass(frozen=True)
class Divergence:
    """The first differing token of one prompt's answers: its index in the answer (0 = the prefill's token), the
    token vanilla and the shape chose, their logit margin in rounding steps, whether they are the top two."""

    prompt: str
    position: int
    vanilla_token: int
    shape_token: int
    margin_ulps: float
    top_two: bool
    within_rounding: bool

    def to_dict(self) -> dict:
        """For report.json, which has no infinity: an answer that stopped early has margin None."""
        out = asdict(self)
        out["margin_ulps"] = None if math.isinf(self.margin_ulps) else self.margin_ulps
        return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (one ending before the other counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(logits: torch.Tensor, first: int, second: int, dtype: torch.dtype) -> tuple[float, bool, bool]:
    """logits (V,) fp32 of one position, the two tokens chosen there → (their logit margin in rounding steps of
    `dtype` at the larger one's magnitude, whether they are the top two, whether rounding explains the choice)."""
    a, b = float(logits[first]), float(logits[second])
    ulps = abs(a - b) / rounding_step(max(abs(a), abs(b)), dtype)
    top_two = {first, second} == set(logits.topk(2).indices.tolist())
    return ulps, top_two, top_two and ulps <= WITHIN_ROUNDING_ULPS.get(dtype, WITHIN_ROUNDING_ULPS[torch.float32])


@torch.inference_mode()
def first_divergence(runtime: Runtime, prompt_id: str, prompt: list[int], vanilla: list[int],
                     shape: list[int]) -> Divergence | None:
    """The first position where the shape's greedy answer leaves vanilla's, with the target's margin there; None
    when they agree. An answer that stops where the other goes on diverges where it stops (no second token to
    weigh: margin ∞, not rounding)."""
    position = first_difference(vanilla, shape)
    if position is None:
        return None
    if position >= min(len(vanilla), len(shape)):
        return Divergence(prompt_id, position, vanilla[position] if position < len(vanilla) else -1,
                          shape[position] if position < len(shape) else -1, math.inf, False, False)
    ids = torch.tensor([prompt + vanilla[:position]], device=runtime.device)  # (1, P + position)
    logits = runtime.prefill(ids, torch.ones_like(ids), 1)[0]  # (V,) fp32, the next token's
    ulps, top_two, within = margin(logits, vanilla[position], shape[position], runtime.lean.dtype)
    return Divergence(prompt_id, position, vanilla[position], shape[position], ulps, top_two, within)
