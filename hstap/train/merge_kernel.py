"""The TTT diagonal merge as Triton kernels: one pass over the diagonal keys forward, two kernels backward.

A step-k query's softmax covers the causal step-0 keys (their attention already computed, with log-sum-exp L)
and k diagonal keys at its own position (hstap.train.attention). Merging them is bandwidth work — every byte of
q, the prefix output and the diagonal keys read once — but the compiled pointwise merge ran ~10× slower than
its bytes allow, ~6 % of the 8B training step in GPU profiles (docs/benchmarks.md). Here:

    merged, total = merge_forward(q, out, lse, k_diag, v_diag, scale)       # one online-softmax pass over the k keys
    dq, dk, dv, d_out, d_lse = merge_backward(q, d_merged, merged, total, k_diag, v_diag, scale, out, lse)

q / out (B, nh, S, hd); lse (B, nh, S) fp32; k_diag / v_diag (B, nkv, k, S, hd); `total` the whole softmax's
log-sum-exp (B, nh, S) fp32. Backward, with w0 = exp(L − total), p_i = exp(d_i − total), D = rowsum(dO ⊙ merged):
d_out = w0·dO, d_lse = w0·(dO·out − D), dd_i = p_i·(dO·v_i − D), dq = Σ dd_i k_i/√hd, and per key/value head
dk_i = Σ_g dd_i q_g/√hd, dv_i = Σ_g p_i dO_g over its G query heads (a second kernel: no atomics). Without
`out`/`lse` (the flash path, whose prefix backward takes the whole softmax) d_out and d_lse are not computed.

Compiled by Triton on CUDA; on a CPU the same kernels run under Triton's interpreter (`TRITON_INTERPRET=1` before
Triton is imported: tests/train/merge_kernel_check.py), held to `merge_forward_reference` /
`merge_backward_reference`, their PyTorch forms.
"""

from __future__ import annotations

import torch

from hstap.compiling import Kernels, tl, triton_available, triton_jit

BLOCK_S = 8  # positions per program. Compiled for sm_90 (Hopper; heads of 128, 8 warps; registers read from the
# cubin with cuobjdump, no GPU needed): 64-78 registers a thread, 3 programs an SM; at 32 positions 240-254, one
# program (8 warps) an SM, too few loads in flight for a kernel that only moves bytes


@triton_jit
def _head_rows(pid_s, pid_bh, NH, G, S, HD: tl.constexpr, HD_P2: tl.constexpr, BLOCK: tl.constexpr):
    """A program's (batch, query head, key/value head) and its block of positions: rows, columns and masks."""
    b = pid_bh // NH
    h = pid_bh % NH
    rows = pid_s * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HD_P2)
    row_ok = rows < S
    return b, h, h // G, rows, cols, row_ok, row_ok[:, None] & (cols[None, :] < HD)


@triton_jit
def _tile(T, b, h, sb, sh, ss, rows, cols, tile):
    """The (BLOCK, HD) tile of a (B, heads, S, hd) tensor at batch b, head h, in fp32 (zeros outside)."""
    return tl.load(T + b * sb + h * sh + rows[:, None] * ss + cols[None, :], mask=tile, other=0.0).to(tl.float32)


@triton_jit
def _fwd(Q, O, LSE, KD, VD, OUT, TOT, scale, S, steps, NH, G,
         sq_b, sq_h, sq_s, so_b, so_h, so_s, sl_b, sl_h, sk_b, sk_h, sk_k, sk_s, sv_b, sv_h, sv_k, sv_s,
         sr_b, sr_h, sr_s, st_b, st_h, HD: tl.constexpr, HD_P2: tl.constexpr, BLOCK: tl.constexpr):
    b, h, kvh, rows, cols, row_ok, tile = _head_rows(tl.program_id(0), tl.program_id(1), NH, G, S, HD, HD_P2,
                                                     BLOCK)
    q = _tile(Q, b, h, sq_b, sq_h, sq_s, rows, cols, tile)
    acc = _tile(O, b, h, so_b, so_h, so_s, rows, cols, tile)
    m = tl.load(LSE + b * sl_b + h * sl_h + rows, mask=row_ok, other=0.0).to(tl.float32)
    lsum = tl.full([BLOCK], 1.0, tl.float32)  # the prefix's weight exp(L − m), m = L so far
    for i in range(steps):
        k = _tile(KD + i * sk_k, b, kvh, sk_b, sk_h, sk_s, rows, cols, tile)
        v = _tile(VD + i * sv_k, b, kvh, sv_b, sv_h, sv_s, rows, cols, tile)
        d = tl.sum(q * k, axis=1) * scale
        m_new = tl.maximum(m, d)
        alpha = tl.exp(m - m_new)
        p = tl.exp(d - m_new)
        acc = acc * alpha[:, None] + p[:, None] * v
        lsum = lsum * alpha + p
        m = m_new
    out = acc / lsum[:, None]
    tl.store(OUT + b * sr_b + h * sr_h + rows[:, None] * sr_s + cols[None, :], out.to(OUT.dtype.element_ty),
             mask=tile)
    tl.store(TOT + b * st_b + h * st_h + rows, m + tl.log(lsum), mask=row_ok)


@triton_jit
def _bwd_rows(Q, DO, R, TOT, KD, VD, O, LSE, DQ, DOUT, DLSE, DD, P, scale, S, steps, NH, G,
              sq_b, sq_h, sq_s, sd_b, sd_h, sd_s, sr_b, sr_h, sr_s, st_b, st_h,
              sk_b, sk_h, sk_k, sk_s, sv_b, sv_h, sv_k, sv_s, so_b, so_h, so_s, sl_b, sl_h,
              sdq_b, sdq_h, sdq_s, sdo_b, sdo_h, sdo_s, sdl_b, sdl_h, sp_b, sp_h, sp_k,
              HD: tl.constexpr, HD_P2: tl.constexpr, BLOCK: tl.constexpr, PREFIX: tl.constexpr):
    """Per query head and block of positions: dq's diagonal share, d_out and d_lse (PREFIX), and each diagonal
    key's dd_i and p_i (B, nh, k, S) for `bwd_keys`."""
    b, h, kvh, rows, cols, row_ok, tile = _head_rows(tl.program_id(0), tl.program_id(1), NH, G, S, HD, HD_P2,
                                                     BLOCK)
    q = _tile(Q, b, h, sq_b, sq_h, sq_s, rows, cols, tile)
    do = _tile(DO, b, h, sd_b, sd_h, sd_s, rows, cols, tile)
    big_d = tl.sum(do * _tile(R, b, h, sr_b, sr_h, sr_s, rows, cols, tile), axis=1)  # D = rowsum(dO ⊙ merged)
    total = tl.load(TOT + b * st_b + h * st_h + rows, mask=row_ok, other=0.0)
    if PREFIX:
        out = _tile(O, b, h, so_b, so_h, so_s, rows, cols, tile)
        lse = tl.load(LSE + b * sl_b + h * sl_h + rows, mask=row_ok, other=0.0).to(tl.float32)
        w0 = tl.exp(lse - total)
        tl.store(DOUT + b * sdo_b + h * sdo_h + rows[:, None] * sdo_s + cols[None, :],
                 (w0[:, None] * do).to(DOUT.dtype.element_ty), mask=tile)
        tl.store(DLSE + b * sdl_b + h * sdl_h + rows, w0 * (tl.sum(do * out, axis=1) - big_d),
                 mask=row_ok)
    dq = tl.zeros([BLOCK, HD_P2], tl.float32)
    for i in range(steps):
        k = _tile(KD + i * sk_k, b, kvh, sk_b, sk_h, sk_s, rows, cols, tile)
        v = _tile(VD + i * sv_k, b, kvh, sv_b, sv_h, sv_s, rows, cols, tile)
        p = tl.exp(tl.sum(q * k, axis=1) * scale - total)
        dd = p * (tl.sum(do * v, axis=1) - big_d)
        dq += dd[:, None] * k
        tl.store(DD + b * sp_b + h * sp_h + i * sp_k + rows, dd, mask=row_ok)
        tl.store(P + b * sp_b + h * sp_h + i * sp_k + rows, p, mask=row_ok)
    tl.store(DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_s + cols[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=tile)


@triton_jit
def _bwd_keys(Q, DO, DD, P, DK, DV, scale, S, steps, NKV, G,
              sq_b, sq_h, sq_s, sd_b, sd_h, sd_s, sp_b, sp_h, sp_k, sdk_b, sdk_h, sdk_k, sdk_s,
              sdv_b, sdv_h, sdv_k, sdv_s, HD: tl.constexpr, HD_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Per key/value head, diagonal key and block of positions: dk_i and dv_i summed over the G query heads."""
    pid = tl.program_id(1)
    i = pid % steps
    b, kvh, _, rows, cols, row_ok, tile = _head_rows(tl.program_id(0), pid // steps, NKV, 1, S, HD, HD_P2, BLOCK)
    dk = tl.zeros([BLOCK, HD_P2], tl.float32)
    dv = tl.zeros([BLOCK, HD_P2], tl.float32)
    for g in range(G):
        h = kvh * G + g
        q = _tile(Q, b, h, sq_b, sq_h, sq_s, rows, cols, tile)
        do = _tile(DO, b, h, sd_b, sd_h, sd_s, rows, cols, tile)
        dd = tl.load(DD + b * sp_b + h * sp_h + i * sp_k + rows, mask=row_ok, other=0.0)
        p = tl.load(P + b * sp_b + h * sp_h + i * sp_k + rows, mask=row_ok, other=0.0)
        dk += dd[:, None] * q
        dv += p[:, None] * do
    tl.store(DK + b * sdk_b + kvh * sdk_h + i * sdk_k + rows[:, None] * sdk_s + cols[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=tile)
    tl.store(DV + b * sdv_b + kvh * sdv_h + i * sdv_k + rows[:, None] * sdv_s + cols[None, :],
             dv.to(DV.dtype.element_ty), mask=tile)


def _strides(t: torch.Tensor, n: int) -> tuple[int, ...]:
    """The first n strides of t; its last dimension must be contiguous (the kernels index it directly)."""
    assert t.stride(-1) == 1 or t.shape[-1] == 1, "the merge kernels read the last dimension contiguously"
    return tuple(t.stride()[:n])


def _warps(hd: int) -> int:
    """8 warps for heads over 64 (half the registers a thread of 4 warps, at 8 positions a program: 64-78 against
    124-139), 4 for smaller heads."""
    return 8 if hd > 64 else 4


def _shape(q: torch.Tensor, k_diag: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    b, nh, s, hd = q.shape
    nkv, steps = k_diag.shape[1], k_diag.shape[2]
    return b, nh, s, hd, nkv, steps


def merge_forward(q, out, lse, k_diag, v_diag, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged output in q's dtype (B, nh, S, hd), the whole softmax's log-sum-exp (B, nh, S) fp32): see the
    module docstring. `merge_forward_reference` computes the same."""
    b, nh, s, hd, nkv, steps = _shape(q, k_diag)
    merged = torch.empty_like(q)  # q's layout: (B, S, nh, hd) in memory, as the projections wrote q
    total = torch.empty(b, nh, s, dtype=torch.float32, device=q.device)
    grid = (-(-s // BLOCK_S), b * nh)
    _fwd[grid](q, out, lse, k_diag, v_diag, merged, total, scale, s, steps, nh, nh // nkv,
               *_strides(q, 3), *_strides(out, 3), *_strides(lse, 2), *_strides(k_diag, 4), *_strides(v_diag, 4),
               *_strides(merged, 3), *_strides(total, 2),
               HD=hd, HD_P2=max(16, 1 << (hd - 1).bit_length()), BLOCK=BLOCK_S, num_warps=_warps(hd))
    return merged, total


def merge_backward(q, d_merged, merged, total, k_diag, v_diag, scale: float, out=None, lse=None):
    """(dq's diagonal share, dk_diag, dv_diag, d_out, d_lse) in the inputs' dtypes (d_lse fp32); d_out and d_lse
    are None without `out` and `lse`. `merge_backward_reference` computes the same."""
    b, nh, s, hd, nkv, steps = _shape(q, k_diag)
    prefix = out is not None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k_diag), torch.empty_like(v_diag)  # the inputs' layouts
    dd = torch.empty(b, nh, steps, s, dtype=torch.float32, device=q.device)
    p = torch.empty_like(dd)
    d_out = torch.empty_like(out) if prefix else dq  # dq: an unread slot
    d_lse = torch.empty(b, nh, s, dtype=torch.float32, device=q.device) if prefix else total
    out_, lse_ = (out, lse) if prefix else (q, total)  # unread without PREFIX
    hd_p2 = max(16, 1 << (hd - 1).bit_length())
    grid = (-(-s // BLOCK_S), b * nh)
    _bwd_rows[grid](q, d_merged, merged, total, k_diag, v_diag, out_, lse_, dq, d_out, d_lse, dd, p, scale, s, steps,
                    nh, nh // nkv, *_strides(q, 3), *_strides(d_merged, 3), *_strides(merged, 3), *_strides(total, 2),
                    *_strides(k_diag, 4), *_strides(v_diag, 4), *_strides(out_, 3), *_strides(lse_, 2),
                    *_strides(dq, 3), *_strides(d_out, 3), *_strides(d_lse, 2), *_strides(dd, 3),
                    HD=hd, HD_P2=hd_p2, BLOCK=BLOCK_S, PREFIX=prefix, num_warps=_warps(hd))
    grid = (-(-s // BLOCK_S), b * nkv * steps)
    _bwd_keys[grid](q, d_merged, dd, p, dk, dv, scale, s, steps, nkv, nh // nkv, *_strides(q, 3),
                    *_strides(d_merged, 3), *_strides(dd, 3), *_strides(dk, 4), *_strides(dv, 4),
                    HD=hd, HD_P2=hd_p2, BLOCK=BLOCK_S, num_warps=_warps(hd))
    return dq, dk, dv, (d_out if prefix else None), (d_lse if prefix else None)


def diagonal_forward(q, out, lse, k_diag, v_diag, scale):
    """Merge the diagonal keys into the prefix result: q/out (B, nh, S, hd), lse (B, nh, S), k/v_diag stacked
    (B, nkv, k, S, hd) → (merged output in q's dtype, the whole softmax's log-sum-exp (B, nh, S) fp32). Also the
    flex path's compiled merge (hstap.train.attention.merge_pointwise), differentiated by autograd there."""
    b, nh, s, hd = q.shape
    nkv = k_diag.shape[1]
    g = nh // nkv
    qg = (q.float() * scale).view(b, nkv, g, 1, s, hd)  # head h = kv head h // G
    diag = (qg * k_diag.float()[:, :, None]).sum(-1)  # (B, nkv, G, k, S)
    prefix_lse = lse.float().view(b, nkv, g, 1, s)
    total = torch.logsumexp(torch.cat([prefix_lse, diag], dim=3), dim=3)  # (B, nkv, G, S)
    p = torch.exp(diag - total[:, :, :, None])  # (B, nkv, G, k, S)
    merged = torch.exp(prefix_lse[:, :, :, 0] - total)[..., None] * out.float().view(b, nkv, g, s, hd) \
        + (p[..., None] * v_diag.float()[:, :, None]).sum(3)  # (B, nkv, G, S, hd)
    return merged.view(b, nh, s, hd).to(q.dtype), total.view(b, nh, s)


def diagonal_backward(q, d_out, out, total, k_diag, v_diag, scale):
    """The diagonal keys' gradients and their share of dq (module docstring), all in fp32 inside →
    (dq (B, nh, S, hd), dk_diag, dv_diag (B, nkv, k, S, hd)), in the inputs' dtypes."""
    b, nh, s, hd = q.shape
    nkv = k_diag.shape[1]
    g = nh // nkv
    qf = q.float().view(b, nkv, g, 1, s, hd)
    kf, vf = k_diag.float()[:, :, None], v_diag.float()[:, :, None]  # (B, nkv, 1, k, S, hd)
    dof = d_out.float().view(b, nkv, g, 1, s, hd)
    rowsum = (dof * out.float().view(b, nkv, g, 1, s, hd)).sum(-1)  # (B, nkv, G, 1, S)
    p = torch.exp((qf * kf).sum(-1) * scale - total.view(b, nkv, g, 1, s))  # (B, nkv, G, k, S)
    dd = p * ((dof * vf).sum(-1) - rowsum)  # (B, nkv, G, k, S)
    dq = (dd[..., None] * kf).sum(3) * scale  # (B, nkv, G, S, hd)
    dk = (dd[..., None] * qf).sum(2) * scale  # (B, nkv, k, S, hd)
    dv = (p[..., None] * dof).sum(2)
    return dq.view(b, nh, s, hd).to(q.dtype), dk.to(k_diag.dtype), dv.to(v_diag.dtype)


def merge_forward_reference(q, out, lse, k_diag, v_diag, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_forward` in PyTorch, fp32 inside (`diagonal_forward`)."""
    return diagonal_forward(q, out, lse, k_diag, v_diag, scale)


def merge_backward_reference(q, d_merged, merged, total, k_diag, v_diag, scale: float, out=None, lse=None):
    """`merge_backward` in PyTorch, fp32 inside (`diagonal_backward`, then the prefix's two gradients)."""
    dq, dk, dv = diagonal_backward(q, d_merged, merged, total, k_diag, v_diag, scale)
    if out is None:
        return dq, dk, dv, None, None
    do = d_merged.float()
    w0 = torch.exp(lse.float() - total)  # (B, nh, S)
    big_d = (do * merged.float()).sum(-1)
    d_out = (w0[..., None] * do).to(out.dtype)
    d_lse = w0 * ((do * out.float()).sum(-1) - big_d)
    return dq, dk, dv, d_out, d_lse


def check(device: torch.device) -> None:
    """Raise unless the kernels equal the PyTorch forms on small fp32 inputs on `device` (an odd length, 2 query
    heads per key/value head, 3 diagonal keys, q in the projections' (B, S, nh, hd) layout)."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    q = rand(1, 37, 4, 16).transpose(1, 2)
    out, lse, k_diag, v_diag, d_merged = rand(1, 4, 37, 16), rand(1, 4, 37), rand(1, 2, 3, 37, 16), \
        rand(1, 2, 3, 37, 16), rand(1, 4, 37, 16)
    got = merge_forward(q, out, lse, k_diag, v_diag, 0.25)
    want = merge_forward_reference(q, out, lse, k_diag, v_diag, 0.25)
    got += merge_backward(q, d_merged, want[0], want[1], k_diag, v_diag, 0.25, out, lse)
    want += merge_backward_reference(q, d_merged, want[0], want[1], k_diag, v_diag, 0.25, out, lse)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# `.enabled = False`: the compiled merge wherever these would run (bench/train_throughput.py --merge times both)
KERNELS = Kernels("Triton TTT merge kernels", "the compiled merge", check, triton_available)


class TritonMerge(torch.autograd.Function):
    """The flex path's merge (hstap.train.attention.merge_diagonal) on these kernels: q, the prefix's out and lse,
    the stacked diagonal keys → merged output; its backward hands the prefix kernel d_out and d_lse."""

    @staticmethod
    def forward(ctx, q, out, lse, k_diag, v_diag, scale: float):
        merged, total = merge_forward(q, out, lse, k_diag, v_diag, scale)
        ctx.save_for_backward(q, out, lse, k_diag, v_diag, merged, total)
        ctx.scale = scale
        return merged

    @staticmethod
    def backward(ctx, d_merged):
        q, out, lse, k_diag, v_diag, merged, total = ctx.saved_tensors
        if d_merged.stride(-1) != 1:
            d_merged = d_merged.contiguous()
        args = (q, d_merged, merged, total, k_diag, v_diag, ctx.scale, out, lse)
        dq, dk, dv, d_out, d_lse = KERNELS.call(merge_backward, args, lambda: merge_backward_reference(*args),
                                                "backward: ")  # PyTorch after a failure: the forward ran here
        return dq, d_out, d_lse, dk, dv, None


def merge(q, out, lse, k_diag, v_diag, scale: float) -> torch.Tensor | None:
    """`TritonMerge` where the kernels are usable on q's device, else None (the caller merges another way). A
    forward that fails turns them off (said once) and returns None."""
    if not KERNELS.usable(q.device):
        return None
    return KERNELS.call(TritonMerge.apply, (q, out, lse, k_diag, v_diag, scale), lambda: None, "forward: ")
