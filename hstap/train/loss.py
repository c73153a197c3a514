"""The draft-vocabulary loss fused with `lm_head`, a block of positions at a time: no (B, S, Vd) logits survive a
TTT step, so memory does not grow with vocabulary × sequence × TTT steps.

    loss, count, argmax = head_soft_cross_entropy(norm(hidden), lm_head.weight, draft_ids, probs, weight)

equals `soft_cross_entropy(lm_head(norm(hidden)), draft_ids, probs, weight)` (hstap.train.ttt, the definition)
with `logits.argmax(-1)`. Each block's logits exist only inside the forward: its loss, its argmax and the loss's
gradients are computed there (d loss/d logits = (softmax · Σ_j p_j − scatter(p)) · weight / count, then through
the block's two matmuls), and the backward only scales the saved gradients by the incoming scalar. So the head
costs its three matmuls (forward, input and weight gradient), none recomputed, and holds one block's logits plus
the (N, H) input gradient and a (Vd, H) fp32 weight gradient per step — neither grows with the vocabulary times
the sequence. Under autocast the matmuls run in the autocast dtype, the softmax in fp32, as before.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from hstap.errors import first_line

CHUNK_BYTES = 512 << 20  # fp32 logits per block: 4,194 positions of a 32,000-token draft vocabulary


def head_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_draft_ids: torch.Tensor,
                            target_probs: torch.Tensor, mask: torch.Tensor, chunk_bytes: int = CHUNK_BYTES,
                            cast: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (B, S, H) normed states; weight (Vd, H) lm_head; target_draft_ids (B, S, K) draft ids (−1 outside
    the draft vocab); target_probs (B, S, K); mask (B, S) bool positions counted. `cast`: `weight` already in
    the matmul dtype (`head_cast`), so the TTT unroll's steps share one cast instead of one each (an 8B
    drafter's 32,000 × 4,096 fp32 head moves ~0.8 GB a cast); its gradient still goes to `weight`.
    Returns (mean loss with grad, number of counted positions, argmax draft id (B, S))."""
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _HeadSoftCE.apply(hidden, weight, target_draft_ids, target_probs, mask, rows, grads, cast)


def head_cast(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """`weight` in the dtype autocast would run a matmul of `like` in, detached (for `cast`); None when that
    is its own dtype (nothing to share). Call it once per forward: it is stale after the optimizer's step."""
    dtype = _compute_dtype(like)
    return None if dtype == weight.dtype else weight.detach().to(dtype)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """What autocast would run a matmul of `t` in (its own dtype outside autocast)."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def block_numbers(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, scale: torch.Tensor,
                  grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block's loss share, argmax and d loss / d logits from its logits, in two reads of the logits when
    compiled (the eager form writes and re-reads fp32 copies of the (c, Vd) block about ten times: 36 % of a
    SmolLM2 TTT step on an H200, 2026-12-02). The CUDA form; `block_numbers_inplace` is the eager one.

    logits (c, Vd) in the matmul dtype; ids (c, K) draft ids (clamped ≥ 0); p (c, K) fp32 teacher probabilities
    (0 where the id was outside the draft vocabulary); scale (c,) each position's share of the mean.
    Returns (Σ scale · loss, argmax (c,), gradient (c, Vd) in the logits' dtype or None).
    The gradient is softmax · Σp · scale everywhere, minus p · scale at the teacher's ids. Those K entries are
    written whole from fp32 values (not added to a rounded softmax term), and an id that appears twice (the
    clamped outsiders share id 0, with p = 0) gets the same value from every copy, so the scatter is exact."""
    x = logits.float()  # (c, Vd); compiled, a register value, never a tensor in memory
    lse = torch.logsumexp(x, -1, keepdim=True)  # (c, 1)
    argmax = x.argmax(-1)  # (c,)
    logq = x.gather(-1, ids) - lse  # (c, K) log q at the teacher's ids
    loss = (-(p * logq).sum(-1) * scale).sum()
    if not grads:
        return loss, argmax, None
    psum = p.sum(-1, keepdim=True)  # (c, 1)
    grad = (torch.exp(x - lse) * (psum * scale[:, None])).to(logits.dtype)  # (c, Vd) softmax · Σp · scale
    same = ids[:, :, None] == ids[:, None, :]  # (c, K, K)
    p_at = (same * p[:, None, :]).sum(-1)  # (c, K) teacher mass on each id, duplicates summed
    at_ids = (logq.exp() * psum - p_at) * scale[:, None]  # (c, K) d loss / d logits at the teacher's ids
    return loss, argmax, grad.scatter(-1, ids, at_ids.to(logits.dtype))


def block_numbers_inplace(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, scale: torch.Tensor,
                          grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`block_numbers` for eager runs (the CPU), in place on one fp32 (c, Vd) buffer with the teacher's share
    subtracted by `scatter_add_` (which sums repeated ids itself): eager, each out-of-place step of `block_numbers`
    allocates and fills another (c, Vd) tensor, and its (c, K, K) comparison costs as much again on a CPU (the head
    of a CPU training step took twice as long)."""
    x = logits.float()  # (c, Vd)
    argmax = x.argmax(-1)  # (c,)
    logq_all = torch.log_softmax(x, -1)  # (c, Vd)
    loss = (-(p * logq_all.gather(-1, ids)).sum(-1) * scale).sum()
    if not grads:
        return loss, argmax, None
    grad = logq_all.exp_().mul_(p.sum(-1, keepdim=True))  # (c, Vd) softmax · Σp
    grad.scatter_add_(-1, ids, -p).mul_(scale[:, None])  # d loss / d logits
    return loss, argmax, grad.to(logits.dtype)


_compiled_failed: list[str] = []  # the compile error, once: every later block runs eager


def _block_fn(device: torch.device):
    """`block_numbers` compiled on CUDA (dynamic shapes: the last block of a step is shorter), its in-place form
    elsewhere."""
    if device.type != "cuda" or _compiled_failed:
        return block_numbers_inplace
    return _compiled_block()


@functools.cache
def _compiled_block():
    compiled = torch.compile(block_numbers, dynamic=True)

    def run(*args):
        if _compiled_failed:
            return block_numbers_inplace(*args)
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 — a compiler failure must not end a training run: say so, go eager
            _compiled_failed.append(first_line(e))
            print(f"hstap: the compiled head loss failed ({_compiled_failed[0]}); continuing with the eager one",
                  file=sys.stderr)
            return block_numbers_inplace(*args)
    return run


class _HeadSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, draft_ids, probs, mask, rows, grads, cast):
        b, s, h = hidden.shape
        dtype = _compute_dtype(hidden)
        flat = hidden.reshape(b * s, h)  # (N, H)
        ids = draft_ids.reshape(b * s, -1).clamp_min(0)  # (N, K)
        p = probs.reshape(b * s, -1).float()  # (N, K)
        count = mask.sum()
        scale = mask.reshape(-1).float() / count.clamp_min(1)  # (N,) each counted position's share of the mean
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(b * s, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(flat) if grads else None  # (N, H)
        grad_w = None  # (Vd, H) fp32: the first block's product, the later blocks' added to it
        numbers = _block_fn(hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = cast if cast is not None and cast.dtype == dtype else weight.to(dtype)  # (Vd, H), once per call
            for start in range(0, b * s, rows):
                part = slice(start, start + rows)
                x = flat[part].to(dtype)  # (c, H)
                block_loss, argmax[part], g = numbers(F.linear(x, w), ids[part], p[part], scale[part], grads)
                loss += block_loss
                if grads:
                    grad_h[part] = g @ w  # (c, H)
                    block_w = (g.t() @ x).float()  # (Vd, H)
                    grad_w = block_w if grad_w is None else grad_w.add_(block_w)
        if grads:
            ctx.save_for_backward(grad_h.view(b, s, h), grad_w)
            ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(count, argmax)
        return loss, count, argmax.view(b, s)

    @staticmethod
    def backward(ctx, grad_loss, _count, _argmax):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, None, None, None
