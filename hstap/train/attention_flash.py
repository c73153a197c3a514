"""One TTT attention step on PyTorch's flash kernels: the causal prefix through `aten`'s flash attention, the
diagonal keys merged in, and a backward that needs no gradient of the kernel's log-sum-exp.

The flex path (hstap.train.attention) differentiates the merge through the prefix's log-sum-exp L, so its kernel
must take L's gradient. The flash kernels do not, and need not: the prefix is one block of a single softmax over
[prefix keys; diagonal keys], and a block's gradient depends only on the *whole* softmax — its output O and
log-sum-exp L* — the way ring attention differentiates one block at a time. Called with (O, L*, dO) instead of the
prefix's own (out, L), the flash backward returns the prefix's exact share of dq, dk and dv:

    dS_prefix = exp(S − L*) ⊙ (dO Vᵀ − rowsum(dO ⊙ O))

and the diagonal keys, (B, nh, S) scores d_i = q·k_i/√hd with weights p_i = exp(d_i − L*), take

    dv_i = p_i dO,   dd_i = p_i (dO·v_i − rowsum(dO ⊙ O)),   dq += Σ dd_i k_i/√hd,   dk_i = dd_i q/√hd

(summed over each key/value head's G query heads). Flex runs the causal prefix well short of a GPU's peak
(docs/benchmarks.md); this is PyTorch's FlashAttention-2 kernel on CUDA, its flash
kernel on a CPU (where the tests compare it with the materialised scores), or with `kernel="cudnn"` cuDNN's fused
attention (CUDA only; the same whole-softmax backward, as PyTorch's own ring attention calls it; cuDNN's kernels
are Hopper-tuned where FlashAttention-2 and flex are not, and at 8,192 positions attention is a fifth of the
step)."""

from __future__ import annotations

import torch

from hstap.compiling import CompiledOr
from hstap.drafter import fused
from hstap.train import merge_kernel
from hstap.train.merge_kernel import diagonal_backward, diagonal_forward


def flash_supported(q: torch.Tensor) -> bool:
    """The flash kernels take fp16/bf16 on CUDA (fp32 too on a CPU) and heads up to 256."""
    if q.shape[-1] > 256:
        return False
    return q.dtype in (torch.float16, torch.bfloat16) if q.is_cuda else q.dtype in (torch.float32, torch.bfloat16)


def cudnn_supported(q: torch.Tensor) -> bool:
    """cuDNN's fused attention: fp16/bf16 on CUDA, heads up to 128."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128


def _cudnn_forward(q, k, v, scale):
    """Causal cuDNN attention → (out, lse (B, nh, S) fp32, what its backward needs). cuDNN keeps the log-sum-exp
    as (B, nh, S, 1)."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse.view(lse.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(d_out, q, k, v, out, lse, scale, extra):
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    d_out = torch.empty_like(out).copy_(d_out) if d_out.stride() != out.stride() else d_out  # out's layout
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        d_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
        True, scale=scale)


def _flash_forward(q, k, v, scale):
    """Causal flash attention → (out (B, nh, S, hd), lse (B, nh, S) fp32, what the CUDA backward needs)."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def _flash_backward(d_out, q, k, v, out, lse, scale, extra):
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, rng, unused = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, True, scale=scale)


def _kernel_backward(q, d_out, out, total, k_diag, v_diag, scale):
    """`diagonal_backward` on the Triton kernels (no prefix gradients: the flash backward takes the whole softmax)."""
    return merge_kernel.merge_backward(q, d_out, out, total, k_diag, v_diag, scale)[:3]


COMPILED_DIAGONAL_FORWARD = CompiledOr(diagonal_forward, "flash TTT diagonal merge", "the eager one")
COMPILED_DIAGONAL_BACKWARD = CompiledOr(diagonal_backward, "flash TTT diagonal backward", "the eager one")


def _run(compiled: CompiledOr, plain, kernel, args: tuple):
    """On CUDA the Triton kernel (hstap.train.merge_kernel, as the flex path's merge), else the fused (compiled)
    form, one graph for every number of keys (`hstap train --no-compile` turns all of them off); eager elsewhere
    and after failures."""
    if args[0].is_cuda and fused.active():
        if merge_kernel.KERNELS.usable(args[0].device):
            return merge_kernel.KERNELS.call(kernel, args, lambda: compiled(args, lambda: plain(*args)),
                                             f"{kernel.__name__}: ")
        return compiled(args, lambda: plain(*args))
    return plain(*args)


KERNELS = {"flash": (_flash_forward, _flash_backward), "cudnn": (_cudnn_forward, _cudnn_backward)}


class FlashTTTAttention(torch.autograd.Function):
    """q (B, nh, S, hd); k0/v0 the step-0 keys repeated to the nh heads (B, nh, S, hd); k_diag/v_diag the
    diagonal keys of steps 1..k stacked (B, nkv, k, S, hd), or None at step 0 → (B, nh, S, hd). `kernel`: the
    prefix's, flash or cudnn (`KERNELS`)."""

    @staticmethod
    def forward(ctx, q, k0, v0, k_diag, v_diag, scale: float, kernel: str = "flash"):
        prefix_forward, ctx.prefix_backward = KERNELS[kernel]
        with torch.autocast(q.device.type, enabled=False):
            out, total, extra = prefix_forward(q, k0, v0, scale)  # at step 0 the prefix is the whole softmax
            if k_diag is not None:
                out, total = _run(COMPILED_DIAGONAL_FORWARD, diagonal_forward, merge_kernel.merge_forward,
                                  (q, out, total, k_diag, v_diag, scale))
        ctx.save_for_backward(q, k0, v0, k_diag, v_diag, out, total)
        ctx.scale, ctx.extra = scale, extra
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k0, v0, k_diag, v_diag, out, total = ctx.saved_tensors
        d_out = d_out.contiguous()
        with torch.autocast(q.device.type, enabled=False):
            dq, dk0, dv0 = ctx.prefix_backward(d_out, q, k0, v0, out, total, ctx.scale, ctx.extra)
            dk_diag = dv_diag = None
            if k_diag is not None:
                dq_diag, dk_diag, dv_diag = _run(COMPILED_DIAGONAL_BACKWARD, diagonal_backward, _kernel_backward,
                                                 (q, d_out, out, total, k_diag, v_diag, ctx.scale))
                dq = dq + dq_diag
        return dq, dk0, dv0, dk_diag, dv_diag, None, None
