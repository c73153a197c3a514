"""Training-time-test attention without (S, S) scores per step: a causal kernel over the step-0 keys, then the
diagonal keys of steps 1..k merged in by log-sum-exp.

    attend = TTTAttention(num_heads=32, num_kv_heads=8)       # one per unroll; each call is the next TTT step
    out = attend(q, k, v)     # q (B, nh, S, hd), k/v (B, nkv, S, hd) of the current step → (B, nh, S, hd)

A step-k query at t sees the step-0 keys of positions ≤ t and its own chain's keys at t (steps 1..k). The
softmax over both sets splits exactly: with L the log-sum-exp of the causal prefix scores and d_i = q·k_i/√hd,

    Z = e^L + Σ_i e^{d_i};   out = (e^L / Z) · softmax_prefix(q, K_0) V_0 + Σ_i (e^{d_i} / Z) · v_i

so only the prefix needs a kernel, and it is plain causal attention that returns L. On CUDA it is flex attention
(compiled, a causal block mask, grouped-query heads without repeating k/v); its backward takes L's gradient, so
the merge is differentiated exactly. Elsewhere (the CPU tests, small runs) the prefix is materialised: exact in
fp32, and the reference the flex path is compared with. The diagonal terms cost (B, nh, S, k) dot products.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hstap.compiling import CompiledOr
from hstap.drafter import fused
from hstap.train import merge_kernel
from hstap.train.attention_flash import FlashTTTAttention, cudnn_supported, flash_supported
from hstap.train.merge_kernel import diagonal_forward

BLOCK = 128  # flex attention's block: sequences are padded up to a multiple (invisible under the causal mask)
BACKENDS = ("auto", "cudnn", "flash", "flex", "flexdiag", "math")
FLEX_COMPILE_MODE: str | None = None  # torch.compile mode of the flex kernel; "max-autotune-no-cudagraphs" times
# its block sizes on the device at the first step (bench/train_throughput.py --flex-mode compares them)
FLEX_MIN_HEAD_DIM = 16  # the compiled flex kernel refuses smaller heads (torch 2.11: "must be at least 16")


class TTTAttention:
    """Keys a step-k query may see: causal step-0 keys plus the diagonal keys of its own steps 1..k.

    `backend`: "flex" (fused kernel, CUDA), "flexdiag" (one flex kernel over the step-0 and the diagonal keys
    together, no merge: `attend_flex_diag`), "flash" (PyTorch's flash kernels, any device, with the whole step's
    backward in hstap.train.attention_flash), "cudnn" (the same with cuDNN's fused attention, CUDA), "math"
    (materialised prefix scores, any device), "auto" = flex on CUDA for heads of at least FLEX_MIN_HEAD_DIM, math
    elsewhere (`use_flex`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"TTT attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        self.rep = num_heads // num_kv_heads
        self.backend = backend
        self.keys: list[torch.Tensor] = []  # per step, (B, nkv, S, hd)
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        scale = q.shape[-1] ** -0.5
        if self.backend in ("flash", "cudnn"):
            return self._flash(q, scale)
        if self.backend == "flexdiag":
            use_flex(self.backend, q.is_cuda, q.shape[-1])  # refuses heads the kernel cannot take, in one line
            return attend_flex_diag(q, self.keys, self.values, scale)
        prefix = causal_prefix_flex if use_flex(self.backend, q.is_cuda, q.shape[-1]) else causal_prefix_math
        out, lse = prefix(q, self.keys[0], self.values[0], scale)  # (B, nh, S, hd), (B, nh, S) fp32
        if len(self.keys) == 1:
            return out
        return merge_diagonal(q, out, lse, self.keys[1:], self.values[1:], scale)

    def _flash(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The step through `FlashTTTAttention`; the step-0 keys are repeated to the query heads once per unroll
        (autograd sums their gradients back)."""
        supported, takes = {"flash": (flash_supported, "fp16/bf16 on CUDA (fp32 too on a CPU) and heads up to 256"),
                             "cudnn": (cudnn_supported, "fp16/bf16 on CUDA and heads up to 128")}[self.backend]
        if not supported(q):
            raise ValueError(f"TTT attention backend '{self.backend}': queries of dtype {q.dtype} and head_dim "
                             f"{q.shape[-1]} on {q.device.type}; it takes {takes}: use --ttt-attention auto")
        if len(self.keys) == 1:
            self._prefix = tuple(t.repeat_interleave(self.rep, dim=1) for t in (self.keys[0], self.values[0]))
        k_diag = v_diag = None
        if len(self.keys) > 1:
            k_diag, v_diag = (torch.stack(t[1:], dim=2) for t in (self.keys, self.values))  # (B, nkv, k, S, hd)
        return FlashTTTAttention.apply(q, *self._prefix, k_diag, v_diag, scale, self.backend)


def use_flex(backend: str, cuda: bool, head_dim: int) -> bool:
    """Whether `backend` runs the flex kernel here. "auto" falls back to math where the compiled kernel cannot run
    (a CPU, or heads smaller than it supports: tiny test drafters); an explicit "flex" or "flexdiag" there is an
    error, named before the compiler's own page-long one."""
    if backend in ("flex", "flexdiag") and cuda and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"TTT attention backend '{backend}': head_dim {head_dim} is below the kernel's minimum "
                         f"{FLEX_MIN_HEAD_DIM}; use --ttt-attention math or auto")
    return backend in ("flex", "flexdiag") or (backend == "auto" and cuda and head_dim >= FLEX_MIN_HEAD_DIM)


def causal_prefix_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with its log-sum-exp, scores materialised: q (B, nh, S, hd), k/v (B, nkv, S, hd) →
    out (B, nh, S, hd) in q's dtype, lse (B, nh, S) fp32."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, nh, S, hd)
    s = q.shape[2]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # (S, S) keys after t
    scores = ((q * scale) @ k.transpose(-1, -2)).float().masked_fill(future, float("-inf"))  # (B, nh, S, S)
    lse = scores.logsumexp(-1)  # (B, nh, S)
    out = torch.exp(scores - lse[..., None]).to(v.dtype) @ v  # (B, nh, S, hd)
    return out, lse


def causal_prefix_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_prefix_math` through compiled flex attention: no (S, S) tensor, half the blocks skipped."""
    s = q.shape[2]
    pad = -s % BLOCK
    if pad:  # one compiled kernel serves every length up to the next block; padded keys sit after every real query
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    out, lse = _flex(q.is_cuda, FLEX_COMPILE_MODE)(q, k, v, _causal_block_mask(s + pad, q.device), scale)
    return out[:, :, :s], lse[:, :, :s]


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@functools.cache  # never evicted: a CUDA graph of a training step (hstap.train.graphed) reads its mask's memory
def _causal_block_mask(length: int, device: torch.device):  # one per padded length: at most max length / BLOCK
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, length, length, device=device)


@functools.cache
def _flex(compiled: bool, mode: str | None = None):
    """flex attention returning (out, lse). Compiled for CUDA (in `mode`), once: lengths vary, and dynamo makes
    the length dynamic after the first change instead of compiling per length. Uncompiled (the CPU tests) it is
    PyTorch's reference implementation. Older torch spells `return_aux` as `return_lse`."""
    from torch.nn.attention import flex_attention as fa

    flex = torch.compile(fa.flex_attention, mode=mode) if compiled else fa.flex_attention
    if hasattr(fa, "AuxRequest"):
        def run(q, k, v, block_mask, scale):
            out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                            return_aux=fa.AuxRequest(lse=True))
            return out, aux.lse
        return run
    return lambda q, k, v, block_mask, scale: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                                                   return_lse=True)


def attend_flex_diag(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """A step-k query's whole attention in one flex call: the keys (and values) of steps 0..k laid end to end, each
    padded to the block, under a mask that lets a query at t see the step-0 keys at ≤ t and every later step's key
    at t only. No log-sum-exp leaves the kernel and nothing is merged after it, so the backward is flex's own.

    The price is the diagonal's blocks: a query block meets one partly masked key block per later step, so step k
    computes k blocks beside the ~S/256 causal ones per query block (+35 % kernel work over a 7-step unroll at
    2,048 positions, +9 % at 8,192), against the merge's separate kernels and the log-sum-exp gradient it replaces.
    q (B, nh, S, hd); keys/values per step (B, nkv, S, hd) → (B, nh, S, hd)."""
    s = q.shape[2]
    pad = -s % BLOCK
    if pad:  # every section padded alike: its padded keys sit at positions no real query sees
        q = F.pad(q, (0, 0, 0, pad))
        keys, values = [F.pad(t, (0, 0, 0, pad)) for t in keys], [F.pad(t, (0, 0, 0, pad)) for t in values]
    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nkv, (k+1)·S', hd)
    block_mask = _ttt_block_mask(s + pad, len(keys), q.device)
    out = _flex_out(q.is_cuda, FLEX_COMPILE_MODE)(q, k_all, v_all, block_mask, scale)
    return out[:, :, :s]


@functools.cache  # never evicted (a CUDA graph reads it); one per padded length and number of steps
def _ttt_block_mask(length: int, sections: int, device: torch.device):
    """The block mask of `attend_flex_diag` over `sections` key sections of `length` each. The mask reads each
    key's position from a tensor, −1 − position on the diagonal sections; every length and step count shares the
    compiled flex attention (tests/train/test_attention.py: 3 graphs under dynamo for 4 lengths × 5 step counts)."""
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.arange(length, device=device, dtype=torch.int32)
    key_pos = torch.cat([positions] + [-1 - positions] * (sections - 1))  # ((sections)·length,)

    def visible(b, h, q_idx, kv_idx):
        pos = key_pos[kv_idx]
        return torch.where(pos >= 0, pos <= q_idx, -1 - pos == q_idx)

    return create_block_mask(visible, None, None, length, sections * length, device=device)


@functools.cache
def _flex_out(compiled: bool, mode: str | None = None):
    """flex attention returning its output only (the flexdiag path needs no log-sum-exp); compiled for CUDA."""
    from torch.nn.attention import flex_attention as fa

    flex = torch.compile(fa.flex_attention, mode=mode) if compiled else fa.flex_attention
    return lambda q, k, v, block_mask, scale: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def merge_diagonal(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Fold the diagonal keys/values (each (B, nkv, S, hd)) into a prefix result `out` (B, nh, S, hd) with
    log-sum-exp `lse` (B, nh, S); see the module docstring. Computed in fp32, returned in q's dtype.

    The k diagonal dot products and the weighted sum of the k values are two batched matmuls over (B, nkv, S)
    with the G = nh / nkv query heads of a key/value head as rows: no (B, nh, S, hd) product per key. Written
    elementwise (one product and one sum per key, then one multiply-add per value) they were a third of a
    SmolLM2 TTT step's device time in a GPU profile (`aten::mul` the largest entry) and ~6k of its operator
    calls."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 matmuls: autocast would run them in bf16
        if _compiled_merge_here(q):
            # the keys stacked here, not in the compiled body: one graph for every number of keys
            k_diag, v_diag = torch.stack(keys, dim=2), torch.stack(values, dim=2)  # (B, nkv, k, S, hd)
            merged = merge_kernel.merge(q, out, lse, k_diag, v_diag, scale)  # None where the kernels cannot run
            if merged is not None:
                return merged
            return COMPILED_MERGE((q, out, lse, k_diag, v_diag, scale),
                                  lambda: _merge_fp32(q, out, lse, keys, values, scale))
        return _merge_fp32(q, out, lse, keys, values, scale)


def merge_pointwise(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, k_diag: torch.Tensor, v_diag: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`_merge_fp32`'s numbers as products and sums over the k diagonal keys, stacked (B, nkv, k, S, hd): the
    form CUDA runs compiled, where the merge (the dot products, the (1+k)-way softmax, the weighted sum, fp32
    inside) fuses into a few kernels forward and backward. The batched-matmul form runs fp32 bmm on a GPU (a
    SIMT SGEMM, no tensor cores) and ~40 operator calls a step, where the step is host-bound at 2,048 positions.
    Eager this form is the slow one (a pass per key), so the CPU keeps `_merge_fp32`."""
    return diagonal_forward(q, out, lse, k_diag, v_diag, scale)[0]  # the flash path's merge, its lse unused


COMPILED_MERGE = CompiledOr(merge_pointwise, "TTT diagonal merge", "the batched-matmul one")


def _compiled_merge_here(q: torch.Tensor) -> bool:
    """The compiled merge runs on CUDA, with the drafter's fused chains on (`hstap train --no-compile` turns both
    off), until it has failed once."""
    return q.is_cuda and fused.active() and not COMPILED_MERGE.failure


def _merge_fp32(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], scale: float) -> torch.Tensor:
    b, nh, s, hd = q.shape
    nkv = keys[0].shape[1]
    g = nh // nkv
    qg = (q.float() * scale).view(b, nkv, g, s, hd).transpose(2, 3)  # (B, nkv, S, G, hd): head h = kv h // G
    k_diag = torch.stack(keys, dim=3).float()  # (B, nkv, S, k, hd)
    v_diag = torch.stack(values, dim=3).float()  # (B, nkv, S, k, hd)
    diag = qg @ k_diag.transpose(-1, -2)  # (B, nkv, S, G, k)
    prefix_lse = lse.view(b, nkv, g, s).transpose(2, 3)[..., None]  # (B, nkv, S, G, 1)
    weights = torch.softmax(torch.cat([prefix_lse, diag], dim=-1), dim=-1)  # (B, nkv, S, G, 1+k)
    prefix = out.float().view(b, nkv, g, s, hd).transpose(2, 3)  # (B, nkv, S, G, hd)
    merged = weights[..., :1] * prefix + weights[..., 1:] @ v_diag  # (B, nkv, S, G, hd)
    return merged.transpose(2, 3).reshape(b, nh, s, hd).to(q.dtype)
