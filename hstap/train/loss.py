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

import sys

import torch
import torch.nn.functional as F

from hstap.compiling import CompiledOr, Kernels, triton_available
from hstap.errors import first_line
from hstap.train import head_kernel

CHUNK_BYTES = 1 << 30  # fp32 logits per block: 8,388 positions of a 32,000-token draft vocabulary (on CUDA the block
# holds them in bf16, with their bf16 gradient: 1 GiB). Larger blocks, fewer read-modify-writes of the fp32 weight
# gradient: a 7-step head at 2,048 positions is 2 blocks (1 of them adding), at 8,192 7 blocks (6 adding) where
# 512 MiB blocks made 4 and 14


def head_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_draft_ids: torch.Tensor,
                            target_probs: torch.Tensor, mask: torch.Tensor, chunk_bytes: int = CHUNK_BYTES,
                            cast: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (B, S, H) normed states; weight (Vd, H) lm_head; target_draft_ids (B, S, K) draft ids (−1 outside
    the draft vocab); target_probs (B, S, K); mask (B, S) bool positions counted. `cast`: `weight` already in
    the matmul dtype (`head_cast`). Returns (mean loss with grad, number of counted positions, argmax draft id
    (B, S)). One step of `head_soft_cross_entropy_steps`."""
    total, _, counts, argmax = head_soft_cross_entropy_steps([hidden], weight, [target_draft_ids], [target_probs],
                                                             [mask], [1.0], chunk_bytes, cast)
    return total, counts[0], argmax[0]


def head_soft_cross_entropy_steps(hiddens: list[torch.Tensor], weight: torch.Tensor, draft_ids: list[torch.Tensor],
                                  probs: list[torch.Tensor], masks: list[torch.Tensor], step_weights: list[float],
                                  chunk_bytes: int = CHUNK_BYTES, cast: torch.Tensor | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TTT unroll's head losses in one call: Σ_k step_weights[k] · head_soft_cross_entropy(hiddens[k], ...).

    One call, not one per step, because the head's weight gradient is then one (Vd, H) fp32 sum that every step's
    blocks add their products into (a matmul with an fp32 output adding into it, on CUDA), where seven calls made
    seven fp32 gradients, each scaled in its backward and summed by autograd: on the 8B shape ~20 GB of
    elementwise traffic a training step (0.5 GB per head-sized fp32 pass), and seven of them alive at once.
    `cast`: `weight` in the matmul dtype (`head_cast`), shared by the steps; its gradient still goes to `weight`.
    Returns (Σ_k w_k · mean loss_k with grad, per-step mean losses (n,) detached, counts (n,), argmax (n, B, S))."""
    n = len(hiddens)
    if not n == len(draft_ids) == len(probs) == len(masks) == len(step_weights):
        raise ValueError("hiddens, draft_ids, probs, masks and step_weights must have one entry per step")
    grads = torch.is_grad_enabled() and (weight.requires_grad or any(h.requires_grad for h in hiddens))
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _HeadSoftCESteps.apply(weight, cast, rows, grads, tuple(float(w) for w in step_weights), n,
                                  *hiddens, *draft_ids, *probs, *masks)


def head_cast(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """`weight` in the dtype autocast would run a matmul of `like` in, detached (for `cast`); None when that
    is its own dtype (nothing to share). Call it once per forward: it is stale after the optimizer's step."""
    dtype = compute_dtype(like)
    return None if dtype == weight.dtype else weight.detach().to(dtype)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """What autocast would run a matmul of `t` in (its own dtype outside autocast)."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def block_numbers(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, scale: torch.Tensor,
                  grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block's loss share, argmax and d loss / d logits from its logits, in two reads of the logits when
    compiled (the eager form writes and re-reads fp32 copies of the (c, Vd) block about ten times: a third of a
    SmolLM2 TTT step in a GPU profile). The CUDA form; `block_numbers_inplace` is the eager one.

    logits (c, Vd) in the matmul dtype; ids (c, K) draft ids (clamped ≥ 0); p (c, K) fp32 teacher probabilities
    (0 where the id was outside the draft vocabulary); scale (c,) each position's share of the mean.
    Returns (each row's loss −Σ p · log q (c,) fp32, unscaled; argmax (c,); gradient (c, Vd) in the logits' dtype
    or None).
    The gradient is softmax · Σp · scale everywhere, minus p · scale at the teacher's ids. Those K entries are
    written whole from fp32 values (not added to a rounded softmax term), and an id that appears twice (the
    clamped outsiders share id 0, with p = 0) gets the same value from every copy, so the scatter is exact."""
    x = logits.float()  # (c, Vd); compiled, a register value, never a tensor in memory
    lse = torch.logsumexp(x, -1, keepdim=True)  # (c, 1)
    argmax = x.argmax(-1)  # (c,)
    logq = x.gather(-1, ids) - lse  # (c, K) log q at the teacher's ids
    loss = -(p * logq).sum(-1)  # (c,)
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
    loss = -(p * logq_all.gather(-1, ids)).sum(-1)  # (c,)
    if not grads:
        return loss, argmax, None
    grad = logq_all.exp_().mul_(p.sum(-1, keepdim=True))  # (c, Vd) softmax · Σp
    grad.scatter_add_(-1, ids, -p).mul_(scale[:, None])  # d loss / d logits
    return loss, argmax, grad.to(logits.dtype)


COMPILED_BLOCK = CompiledOr(block_numbers, "head loss", "the eager one")  # `.failure` once it failed


HEAD_KERNEL = Kernels("Triton head-loss kernel", "the compiled head loss",
                      lambda device: head_kernel.check(device, block_numbers), triton_available)


def _block_fn(device: torch.device):
    """On CUDA the Triton kernel (hstap.train.head_kernel), else `block_numbers` compiled (dynamic shapes: the
    last block is shorter); its in-place form elsewhere and after failures."""
    if device.type != "cuda":
        return block_numbers_inplace
    if HEAD_KERNEL.usable(device):
        return _kernel_block
    if COMPILED_BLOCK.failure:
        return block_numbers_inplace
    return _compiled_block


def _compiled_block(*args):
    return COMPILED_BLOCK(args, lambda: block_numbers_inplace(*args))


def _kernel_block(*args):
    return HEAD_KERNEL.call(head_kernel.block, args, lambda: _compiled_block(*args))


def _add_weight_grad(acc: torch.Tensor | None, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc + gᵀ·x in fp32 (acc None: gᵀ·x), g (c, Vd) and x (c, H) in the matmul dtype. On CUDA one matmul whose
    fp32 output is the sum (`out_dtype`, no bf16 product rounded, cast and added in three more passes); on other
    devices, or where that overload is missing, the product in the matmul dtype, then cast and added."""
    if g.dtype != torch.float32 and g.device.type == "cuda" and not _no_out_dtype:
        try:
            if acc is None:
                return torch.mm(g.t(), x, out_dtype=torch.float32)
            return torch.addmm(acc, g.t(), x, out_dtype=torch.float32)
        except (RuntimeError, TypeError) as e:  # an older torch: say so once, then the three-pass form
            _no_out_dtype.append(first_line(e))
            print(f"hstap: fp32-output matmul unavailable ({_no_out_dtype[0]}); head gradient in three passes",
                  file=sys.stderr)
    block = (g.t() @ x).float()  # (Vd, H)
    return block if acc is None else acc.add_(block)


_no_out_dtype: list[str] = []


class _HeadSoftCESteps(torch.autograd.Function):
    """The steps' positions as one (steps · B·S)-row problem cut into blocks of equal size: a block may hold rows of
    two steps (each row carries its own step's teacher, mask share and weight), so at 2,048 positions a 7-step head
    is 2 blocks of 7,168 rows instead of 7 of 2,048 — 1 instead of 6 fp32 read-modify-writes of the (Vd, H) weight
    gradient (on the 8B shape 32,000 × 4,096 fp32, 0.5 GB read and written each time)."""

    @staticmethod
    def forward(ctx, weight, cast, rows, grads, step_weights, n, *tensors):
        hiddens, all_ids, all_probs, masks = (tensors[i * n:(i + 1) * n] for i in range(4))
        b, s, h = hiddens[0].shape
        per_step = b * s
        dtype = compute_dtype(hiddens[0])
        numbers = _block_fn(hiddens[0].device)
        device = weight.device
        counts = torch.stack([m.sum() for m in masks])  # (n,)
        # each row's step weight, filled on the device (a tensor built from host data would be a copy, which a CUDA
        # graph's capture refuses: hstap.train.graphed)
        row_w = torch.cat([torch.full((per_step,), w, dtype=torch.float32, device=device) for w in step_weights])
        flat = _rows([x.to(dtype) for x in hiddens], h)  # (n·N, H)
        ids = _rows(all_ids, all_ids[0].shape[-1]).clamp_min(0)  # (n·N, K)
        p = _rows(all_probs, all_probs[0].shape[-1]).float()  # (n·N, K)
        share = (_rows(masks, 1).view(-1).float()
                 / counts.clamp_min(1).float().repeat_interleave(per_step))  # (n·N,) each row's share of its mean
        scale = share * row_w  # the gradient carries the step's weight
        total_rows = n * per_step
        block = -(-total_rows // -(-total_rows // rows))  # ≤ rows, the blocks as equal as they come
        row_loss = torch.empty(total_rows, dtype=torch.float32, device=device)
        argmax = torch.empty(total_rows, dtype=torch.long, device=device)
        grad_flat = torch.empty_like(flat) if grads else None  # (n·N, H)
        grad_w = None  # (Vd, H) fp32, every block added in
        with torch.autocast(device.type, enabled=False):
            w = cast if cast is not None and cast.dtype == dtype else weight.to(dtype)  # (Vd, H), once per call
            for start in range(0, total_rows, block):
                part = slice(start, start + block)
                x = flat[part]  # (c, H)
                row_loss[part], argmax[part], g = numbers(F.linear(x, w), ids[part], p[part], scale[part], grads)
                if grads:
                    torch.mm(g, w, out=grad_flat[part])  # (c, H), written in place (rows of a contiguous tensor)
                    grad_w = _add_weight_grad(grad_w, g, x)
        losses = (row_loss * share).view(n, per_step).sum(1)  # (n,) per-step mean losses
        total = (row_loss * scale).sum()  # Σ_k w_k · loss_k
        if grads:
            if grad_w is None:
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device)
            ctx.save_for_backward(grad_w, grad_flat)
            ctx.present = [w != 0.0 for w in step_weights]  # a step of weight 0 sends no gradient
            ctx.weight_dtype, ctx.shape = weight.dtype, (b, s, h)
        ctx.n = n
        ctx.mark_non_differentiable(losses, counts, argmax)
        return total, losses, counts, argmax.view(n, b, s)

    @staticmethod
    def backward(ctx, grad_total, _losses, _counts, _argmax):
        grad_w, grad_flat = ctx.saved_tensors
        per_step = grad_flat.view(ctx.n, *ctx.shape)
        grad_hs = [per_step[k] * grad_total if present else None for k, present in enumerate(ctx.present)]
        return ((grad_w * grad_total).to(ctx.weight_dtype), None, None, None, None, None, *grad_hs,
                *([None] * (3 * ctx.n)))


def _rows(per_step: list[torch.Tensor] | tuple[torch.Tensor, ...], width: int) -> torch.Tensor:
    """The steps' (B, S, width) tensors as one (n·B·S, width) tensor, steps after one another (no copy for one)."""
    flat = [t.reshape(-1, width) for t in per_step]
    return flat[0] if len(flat) == 1 else torch.cat(flat)
