"""The head loss's block (hstap.train.loss.block_numbers) as one Triton kernel: two passes over each row of logits.

A TTT step's head turns each block of logits (c, Vd) into each row's loss against the teacher, its argmax and the
gradient d loss / d logits. The bytes that takes are one read of the logits to find the row's max, argmax and
log-sum-exp (online: the max and the sum in one pass), a second read to write the gradient, and the K teacher
entries. The compiled `block_numbers` took twice as long as those bytes need, on the 8B step a few percent of it
(docs/benchmarks.md has the GPU profiles). Here one program per row:

    pass 1   m, Σ exp(x − m), argmax over the row, a chunk at a time      → lse = m + log Σ
             loss = −Σ_j p_j (x[id_j] − lse)
    pass 2   grad = exp(x − lse) · Σp · scale                              (when gradients are wanted)
             grad[id_j] = (exp(x[id_j] − lse) · Σp − Σ_{i: id_i = id_j} p_i) · scale   after a barrier

    loss, argmax, grad = block(logits, ids, p, scale, grads=True)     # `block_numbers`' contract

On a CPU the kernel runs under Triton's interpreter (tests/train/head_kernel_check.py); `block_numbers` is the
form it is held to, once per process on the device (`hstap.train.loss.HEAD_KERNEL`), before a training block
uses it.
"""

from __future__ import annotations

import torch

from hstap.compiling import tl, triton_jit

BLOCK_V = 2048  # logits per chunk of a row: 8 fp32 values a thread at 8 warps


@triton_jit
def _head(X, IDS, P, SCALE, LOSS, ARGMAX, GRAD, V, K, sx, sid, sp, sg,
          BLOCK: tl.constexpr, K_P2: tl.constexpr, GRADS: tl.constexpr):
    row = tl.program_id(0)
    x_row = X + row * sx
    cols = tl.arange(0, BLOCK)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    best = tl.zeros([1], tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        chunk_arg = tl.argmax(x, axis=0).to(tl.int64) + start
        best = tl.where(chunk_max > m, chunk_arg, best)  # strictly greater: the first maximum wins, as torch's
        m_new = tl.maximum(m, chunk_max)
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    ks = tl.arange(0, K_P2)
    k_ok = ks < K
    ids = tl.load(IDS + row * sid + ks, mask=k_ok, other=0)
    p = tl.load(P + row * sp + ks, mask=k_ok, other=0.0).to(tl.float32)
    logq = tl.load(x_row + ids, mask=k_ok, other=0.0).to(tl.float32) - lse
    tl.store(LOSS + row + tl.arange(0, 1), -tl.sum(p * logq, axis=0) + tl.zeros([1], tl.float32))
    tl.store(ARGMAX + row + tl.arange(0, 1), best)
    if GRADS:
        scale = tl.load(SCALE + row)
        psum = tl.sum(p, axis=0)
        g_row = GRAD + row * sg
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            tl.store(g_row + idx, (tl.exp(x - lse) * (psum * scale)).to(GRAD.dtype.element_ty), mask=idx < V)
        tl.debug_barrier()  # the softmax terms above, then the teacher's entries over them
        same = (ids[:, None] == ids[None, :]) & k_ok[None, :]
        p_at = tl.sum(tl.where(same, p[None, :], 0.0), axis=1)  # teacher mass on each id, repeats summed
        at_ids = (tl.exp(logq) * psum - p_at) * scale
        tl.store(g_row + ids, at_ids.to(GRAD.dtype.element_ty), mask=k_ok)


def block(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, scale: torch.Tensor,
          grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`hstap.train.loss.block_numbers` on the kernel: logits (c, Vd); ids (c, K) draft ids ≥ 0; p (c, K) fp32;
    scale (c,) → (each row's loss (c,) fp32, argmax (c,), gradient (c, Vd) in the logits' dtype or None)."""
    c, vd = logits.shape
    k = ids.shape[1]
    assert logits.stride(1) == 1 and ids.stride(1) == 1 and p.stride(1) == 1, "rows must be contiguous"
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(c, dtype=torch.long, device=logits.device)
    grad = torch.empty_like(logits) if grads else None
    scale = scale.contiguous()
    _head[(c,)](logits, ids, p, scale, loss, argmax, grad if grads else logits, vd, k, logits.stride(0),
                ids.stride(0), p.stride(0), (grad if grads else logits).stride(0),
                BLOCK=BLOCK_V, K_P2=max(16, 1 << (k - 1).bit_length()), GRADS=grads, num_warps=8)
    return loss, argmax, grad


def check(device: torch.device, reference) -> None:
    """Raise unless the kernel equals `reference` (`block_numbers`) on a small fp32 block on `device`: a vocabulary
    that is not a multiple of the chunk, clamped outsiders sharing id 0 with p = 0 beside a real id 0, a repeated
    id, a tie for the maximum."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2500, generator=gen)
    logits[2, 7] = logits[2, 2100] = logits[2].max() + 1  # a tie: the first index wins
    ids = torch.randint(1, 2500, (6, 5), generator=gen)
    ids[:, 0] = 0
    ids[:3, 3:] = 0
    ids[4, 2] = ids[4, 1]
    p = torch.softmax(torch.randn(6, 5, generator=gen), -1)
    p[:3, 3:] = 0
    scale = torch.rand(6, generator=gen)
    args = [t.to(device) for t in (logits, ids, p, scale)]
    for grads in (True, False):
        got, want = block(*args, grads), reference(*args, grads)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1]), (got[1], want[1])
        if grads:
            torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
        else:
            assert got[2] is None
