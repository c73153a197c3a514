"""The TTT diagonal merge's Triton kernels (hstap.train.merge_kernel): interpreted on the CPU they equal their
PyTorch forms and carry the flex path to the materialised one (merge_kernel_check.py, in a process that sets
TRITON_INTERPRET=1 before importing Triton); their backward's PyTorch form equals autograd; a kernel that fails
costs one line on stderr and the merge goes on another way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hstap.compiling import Kernels
from hstap.train import merge_kernel
from hstap.train.merge_kernel import diagonal_forward
from tests.train.interpreted import run_interpreted


def test_the_kernels_interpreted_on_the_cpu_equal_their_pytorch_forms():
    run_interpreted(Path(__file__).with_name("merge_kernel_check.py"), "merge kernels: ok")


def test_the_backward_reference_equals_autograd_through_the_merge():
    """d_out and d_lse (what the flex kernel's backward receives), dq, dk and dv of `merge_backward_reference`
    against autograd on `diagonal_forward` in fp64 (the reference computes in fp32 inside: fp32 tolerance)."""
    gen = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, out, lse = rand(2, 4, 9, 8), rand(2, 4, 9, 8), rand(2, 4, 9)
    k_diag, v_diag = rand(2, 2, 3, 9, 8), rand(2, 2, 3, 9, 8)
    merged, total = diagonal_forward(q, out, lse, k_diag, v_diag, 0.3)
    d_merged = torch.randn(merged.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(merged, (q, out, lse, k_diag, v_diag), d_merged)
    dq, dk, dv, d_out, d_lse = merge_kernel.merge_backward_reference(
        q.detach(), d_merged, merged.detach(), total.detach(), k_diag.detach(), v_diag.detach(), 0.3, out.detach(),
        lse.detach())
    # dq here is the merge's own share: q also reaches the prefix through the kernel, which autograd does not see
    # in diagonal_forward (out and lse are leaves there), so the two compare directly
    for got, w in zip((dq, d_out, d_lse, dk, dv), want):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)


def test_a_failing_kernel_is_said_once_and_the_merge_goes_on_without_it(monkeypatch, capsys):
    monkeypatch.setattr(merge_kernel, "KERNELS", Kernels(merge_kernel.KERNELS.what, merge_kernel.KERNELS.instead,
                                                         lambda device: None, lambda: True))

    def broken(*args):
        raise RuntimeError("PTX not supported\nsecond line")

    monkeypatch.setattr(merge_kernel, "merge_forward", broken)
    q = torch.randn(1, 2, 5, 4)
    args = (q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5), torch.randn(1, 1, 2, 5, 4), torch.randn(1, 1, 2, 5, 4))
    assert merge_kernel.merge(*args, 0.5) is None
    assert merge_kernel.merge(*args, 0.5) is None  # later calls: off, silently
    assert merge_kernel.KERNELS.failure == "forward: RuntimeError: PTX not supported"
    assert capsys.readouterr().err.strip().splitlines() == [
        "hstap: Triton TTT merge kernels off (forward: RuntimeError: PTX not supported); continuing with the "
        "compiled merge"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_on_cuda_equal_their_pytorch_forms_at_the_8b_shape():
    """Compiled by Triton: the usability check passes, and at the 8B shape (32 query heads over 8, heads of 128,
    2,048 positions, 6 diagonal keys, bf16) every output is the fp32 PyTorch form's within one bf16 rounding."""
    assert merge_kernel.KERNELS.usable(torch.device("cuda")), merge_kernel.KERNELS.failure
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    q = rand(1, 2048, 32, 128).transpose(1, 2)
    out, lse = rand(1, 32, 2048, 128), torch.randn(1, 32, 2048, generator=gen, device="cuda")
    k_diag, v_diag, d_merged = rand(1, 8, 6, 2048, 128), rand(1, 8, 6, 2048, 128), rand(1, 32, 2048, 128)
    got = merge_kernel.merge_forward(q, out, lse, k_diag, v_diag, 128 ** -0.5)
    want = merge_kernel.merge_forward_reference(q, out, lse, k_diag, v_diag, 128 ** -0.5)
    got += merge_kernel.merge_backward(q, d_merged, want[0], want[1], k_diag, v_diag, 128 ** -0.5, out, lse)
    want += merge_kernel.merge_backward_reference(q, d_merged, want[0], want[1], k_diag, v_diag, 128 ** -0.5, out,
                                                  lse)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.float(), w.float(), rtol=2 ** -7, atol=2 ** -7)
