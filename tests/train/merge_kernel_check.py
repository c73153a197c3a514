"""Run by tests/train/test_merge_kernel.py in a process with TRITON_INTERPRET=1 (set before Triton is imported):
the Triton merge kernels, interpreted on the CPU, against their PyTorch forms, and the flex TTT path with them
against the materialised one. Exits non-zero (an AssertionError) on any difference."""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.attention.flex_attention as fa

from hstap.train import attention, merge_kernel

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
FP32 = dict(rtol=1e-4, atol=5e-5)  # fp32 sums in another order; a wrong kernel is off by O(1)


def case(b: int, nh: int, nkv: int, s: int, hd: int, steps: int, dtype: torch.dtype, tol: dict) -> None:
    gen = torch.Generator().manual_seed(steps * 100 + hd)
    rand = lambda *shape: (2 * torch.randn(*shape, generator=gen)).to(dtype)  # noqa: E731
    q = rand(b, s, nh, hd).transpose(1, 2)  # the projections' layout
    out, lse = rand(b, nh, s, hd), rand(b, nh, s).float()
    k_diag, v_diag, d_merged = rand(b, nkv, steps, s, hd), rand(b, nkv, steps, s, hd), rand(b, nh, s, hd)
    got = merge_kernel.merge_forward(q, out, lse, k_diag, v_diag, hd ** -0.5)
    want = merge_kernel.merge_forward_reference(q, out, lse, k_diag, v_diag, hd ** -0.5)
    assert got[0].stride() == q.stride(), "the merged output is written in q's layout"
    for prefix in (True, False):
        extra = (out, lse) if prefix else ()
        got_b = merge_kernel.merge_backward(q, d_merged, want[0], want[1], k_diag, v_diag, hd ** -0.5, *extra)
        want_b = merge_kernel.merge_backward_reference(q, d_merged, want[0], want[1], k_diag, v_diag, hd ** -0.5,
                                                       *extra)
        for name, a, w in zip(("merged", "total", "dq", "dk", "dv", "d_out", "d_lse"), got + got_b, want + want_b):
            if w is None:
                assert a is None, name
                continue
            assert a.dtype == w.dtype, (name, a.dtype, w.dtype)
            torch.testing.assert_close(a.float(), w.float(), **tol, msg=lambda m: f"{name}: {m}")


def flex_path_with_the_kernels() -> None:
    """TTTAttention("flex") merging through the kernels (uncompiled flex on the CPU, as tests/train/test_attention.py
    runs it) equals the materialised path, forward and gradients, over a 3-step unroll."""
    fa._validate_device = lambda *args: None  # the CPU's flex has a plain-PyTorch backward (test_attention.py)
    gen = torch.Generator().manual_seed(0)
    qkv = [tuple((2 * torch.randn(*shape, generator=gen)).requires_grad_() for shape in
                 ((1, 4, 37, 16), (1, 2, 37, 16), (1, 2, 37, 16))) for _ in range(3)]
    want_attend = attention.TTTAttention(4, 2, "math")
    want = [want_attend(*step) for step in qkv]  # the CPU's own merge
    attention._compiled_merge_here = lambda q: True  # from here on the CUDA route, through the kernels
    calls = []
    real = merge_kernel.TritonMerge.apply
    merge_kernel.TritonMerge.apply = lambda *a: calls.append(1) or real(*a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got_attend = attention.TTTAttention(4, 2, "flex")
        got = [got_attend(*step) for step in qkv]
    assert len(calls) == 2 and not merge_kernel.KERNELS.failure, (len(calls), merge_kernel.KERNELS.failure)
    leaves = [t for step in qkv for t in step]
    probe = [torch.randn(w.shape, generator=gen) for w in want]
    grads = torch.autograd.grad(sum((a * p).sum() for a, p in zip(got, probe)), leaves)
    want_grads = torch.autograd.grad(sum((w * p).sum() for w, p in zip(want, probe)), leaves)
    for a, w in zip(got + list(grads), want + list(want_grads)):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    case(2, 4, 2, 21, 16, 3, torch.float32, FP32)  # two sequences of an odd length: a partly masked last block
    case(1, 8, 2, 24, 12, 1, torch.float32, FP32)  # one diagonal key; a head dim that is not a power of two
    case(1, 4, 1, 19, 16, 6, torch.float32, FP32)  # one key/value head for all four query heads, six keys
    # bf16 in and out: the kernels and the PyTorch forms both compute in fp32 and round once, so they differ by
    # at most a rounding step (1 in 2**8) of the larger value
    case(1, 4, 2, 21, 16, 3, torch.bfloat16, dict(rtol=2 ** -7, atol=2 ** -7))
    merge_kernel.check(torch.device("cpu"))
    flex_path_with_the_kernels()
    print("merge kernels: ok")
