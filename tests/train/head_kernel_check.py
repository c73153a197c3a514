"""Run by tests/train/test_head_kernel.py in a process with TRITON_INTERPRET=1 (set before Triton is imported):
the head-loss kernel, interpreted on the CPU, against `block_numbers` (the compiled CUDA path's PyTorch form).
Exits non-zero (an AssertionError) on any difference."""

from __future__ import annotations

import os

import torch

from hstap.train import head_kernel
from hstap.train.loss import block_numbers

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


def case(c: int, vd: int, k: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(c, vd, generator=gen)).to(dtype)
    ids = torch.randint(0, vd, (c, k), generator=gen)
    ids[: c // 2, k // 2:] = 0  # clamped outsiders on id 0, p = 0
    p = torch.softmax(torch.randn(c, k, generator=gen), -1)
    p[: c // 2, k // 2:] = 0
    scale = torch.rand(c, generator=gen)
    for grads in (True, False):
        got, want = head_kernel.block(logits, ids, p, scale, grads), block_numbers(logits, ids, p, scale, grads)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # fp32 either way
        assert torch.equal(got[1], want[1])
        if grads:
            assert got[2].dtype == logits.dtype
            tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
            torch.testing.assert_close(got[2].float(), want[2].float(), **tol)
        else:
            assert got[2] is None


if __name__ == "__main__":
    head_kernel.check(torch.device("cpu"), block_numbers)  # ties, repeats, a vocabulary past one chunk
    case(7, 5000, 32, torch.float32, 1)  # K = 32 as the store's teacher; three chunks, the last one partial
    case(5, 300, 3, torch.float32, 2)  # K not a power of two, one partial chunk
    case(4, 4200, 8, torch.bfloat16, 3)  # bf16 logits and gradient: one rounding of the same fp32 value
    print("head kernel: ok")
