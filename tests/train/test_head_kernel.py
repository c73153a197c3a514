"""The head loss's Triton kernel (hstap.train.head_kernel): interpreted on the CPU it equals `block_numbers`
(head_kernel_check.py, in a process that sets TRITON_INTERPRET=1 before importing Triton); a kernel that fails
costs one line on stderr and the block goes on compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hstap.compiling import Kernels
from hstap.train import head_kernel, loss
from tests.train.interpreted import run_interpreted


def test_the_kernel_interpreted_on_the_cpu_equals_block_numbers():
    run_interpreted(Path(__file__).with_name("head_kernel_check.py"), "head kernel: ok")


def test_a_failing_kernel_is_said_once_and_the_block_goes_on_compiled(monkeypatch, capsys):
    monkeypatch.setattr(loss, "HEAD_KERNEL", Kernels(loss.HEAD_KERNEL.what, loss.HEAD_KERNEL.instead,
                                                     lambda device: None, lambda: True))

    def broken(*args):
        raise RuntimeError("out of resources: shared memory\nsecond line")

    compiled = []
    monkeypatch.setattr(head_kernel, "block", broken)
    monkeypatch.setattr(loss, "_compiled_block", lambda *a: compiled.append(1) or loss.block_numbers(*a))
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 40, generator=gen), torch.randint(0, 40, (3, 4), generator=gen),
            torch.softmax(torch.randn(3, 4, generator=gen), -1), torch.rand(3, generator=gen), True)
    want = loss.block_numbers(*args)
    for _ in range(2):
        got = loss._kernel_block(*args)
        for a, w in zip(got, want):
            assert torch.equal(a, w)
    assert compiled == [1, 1] and loss.HEAD_KERNEL.failure == "RuntimeError: out of resources: shared memory"
    assert capsys.readouterr().err.strip().splitlines() == [
        "hstap: Triton head-loss kernel off (RuntimeError: out of resources: shared memory); continuing with the "
        "compiled head loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_on_cuda_equals_block_numbers_on_a_real_block():
    """Compiled by Triton: the usability check passes, and on a 2,048 × 32,000 bf16 block (the 8B step's) the
    loss and argmax are fp32's and the gradient within one bf16 rounding."""
    assert loss.HEAD_KERNEL.usable(torch.device("cuda")), loss.HEAD_KERNEL.failure
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(2048, 32000, generator=gen, device="cuda")).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (2048, 32), generator=gen, device="cuda")
    p = torch.softmax(torch.randn(2048, 32, generator=gen, device="cuda"), -1)
    scale = torch.full((2048,), 1 / 2048, device="cuda")
    got, want = head_kernel.block(logits, ids, p, scale, True), loss.block_numbers(logits, ids, p, scale, True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2 ** -7, atol=1e-9)
