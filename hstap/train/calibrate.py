"""Calibrate the held-out τ estimate against a measured τ, at every evaluation of a training run.

The estimate (`hstap.train.ttt.simulated_tau`) replays greedy chain decoding over teacher-forced agreement on
held-out answers; it is exact only when those answers are the target's own greedy output at the decoding dtype
(tests/train/test_simulated_tau.py: equal cycle for cycle in fp32). The measurement decodes a few held-out prompts
greedily with real chain speculative decoding (`hstap.evaluate.methods.Methods`, the runtime `hstap eval` runs, all
prompts as one batch) with the current drafter against the target, on the training device. Logged side by side
with their gap, the two say how far the estimate of a long run can be trusted. The prompts are the training source's held-out
conversations (the first user turn, up to the first answer token): MT-bench is for judging, never for tuning.

    prompts = calibration_prompts(source, held_idx, n=8)
    calibrate(target, drafter, prompts, chain=3, max_new_tokens=64, tau_est=heldout["tau_est"])
    # {"chain": 3, "tau_measured": 1.9, "tau_est": 2.1, "gap": -0.2, "prompts": 8, "tokens": 512, ...}
"""

from __future__ import annotations

import copy
import math
import time

import torch

from hstap.evaluate.results import MethodResult, Prompt
from hstap.evaluate.methods import Methods
from hstap.runtime.shapes import DraftShape

MAX_PROMPT_TOKENS = 1024  # longer held-out prompts are passed over: the measurement should cost seconds


def calibration_indices(source, indices: list[int], n: int) -> list[int]:
    """The first `n` samples of `indices` (held-out) that have an answer and a prompt of at most
    MAX_PROMPT_TOKENS tokens."""
    chosen: list[int] = []
    for i in indices:
        if len(chosen) == n:
            break
        answer = source.token_masks(i)[1].nonzero()  # (A, 1) positions of answer tokens
        if answer.numel() and 0 < int(answer[0]) <= MAX_PROMPT_TOKENS:
            chosen.append(i)
    return chosen


def prompt_of(source, index: int) -> Prompt:
    """Sample `index` cut just before its first answer token (the assistant header included, as `render_prompt`
    writes it)."""
    ids, loss_mask = source.token_masks(index)
    return Prompt(source.ids[index], ids[:int(loss_mask.nonzero()[0])].tolist())


def calibration_prompts(source, indices: list[int], n: int) -> list[Prompt]:
    """`calibration_indices`' samples as prompts (`prompt_of`)."""
    return [prompt_of(source, i) for i in calibration_indices(source, indices, n)]


def _without_gradients(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters hold no `.grad`: a trainer that keeps its gradients between steps
    (`--cuda-graphs`, `--grad-reduce after`) would have them copied too (for an 8B drafter 1.7 GB, then 0.85 GB more
    in bf16) at every evaluation."""
    grads = [p.grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.grad = None
        return copy.deepcopy(model)
    finally:
        for p, g in zip(model.parameters(), grads):
            p.grad = g


@torch.no_grad()
def calibrate(target, drafter, prompts: list[Prompt], chain: int, max_new_tokens: int, tau_est: dict,
              tau_est_same: float = math.nan) -> dict:
    """Greedy chain speculative decoding of every prompt; → the measured τ next to the estimate for the same chain
    length (`tau_est` maps chain length → estimated τ, as `evaluate_heldout` returns it) and their gap, and next
    to `tau_est_same`, the estimate replayed on these very prompts' held-out answers cut at `max_new_tokens`
    (`hstap.train.heldout.replayed_first_answers`). The first gap mixes two things: the first tokens of a few answers
    against whole answers with their repetitive tails, and the estimate's own error; `gap_same` is the second
    alone (0 in fp32 on the target's own greedy answers)."""
    if not prompts:
        return {}
    shape = DraftShape.parse(f"chain:{chain}")
    start = time.perf_counter()
    # a copy in the target's dtype, as `hstap eval` loads a drafter (bf16 on a GPU): the τ a user will measure
    serving = _without_gradients(drafter).to(dtype=target.model.dtype).eval()
    longest = max(len(p.ids) for p in prompts) + max_new_tokens
    # unfused: τ does not depend on kernels, and a compile per calibration would come out of the training budget
    methods = Methods(target.model, serving, len(prompts), longest, [shape], fused=False)
    generations = methods.run(shape, [p.ids for p in prompts], max_new_tokens, set(target.stop_ids))
    method = MethodResult(shape.spec, shape, generations)
    estimate = float(tau_est.get(chain, tau_est.get(str(chain), math.nan)))
    return {"chain": chain, "tau_measured": method.tau, "tau_est": estimate, "gap": method.tau - estimate,
            "tau_est_same": tau_est_same, "gap_same": method.tau - tau_est_same,
            "prompts": len(prompts), "tokens": method.tokens, "verify_forwards": method.verify_forwards,
            "seconds": time.perf_counter() - start}
