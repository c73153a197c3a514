"""The hand-written Triton kernels compile for an H200 (sm_90) here, without a GPU: Triton's compiler and the
ptxas in its wheel build each kernel's cubin as a CUDA process would, which the CPU interpreter (the other kernel
tests) never does (hstap.train.kernel_resources; bench/kernel_resources.py prints the table). Each must fit its
registers without spilling to local memory, and leave room for at least two programs an SM (≤ 128 registers a
thread at 8 warps), since they only move bytes and need loads in flight."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
from hstap.train.kernel_resources import cuobjdump_path, kernels, programs_per_sm, resources  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice of a default


@pytest.mark.skipif(not os.path.exists(cuobjdump_path()), reason="this Triton wheel ships no cuobjdump")
@pytest.mark.parametrize("name", ["merge forward", "merge backward, rows", "merge backward, keys", "head loss"])
def test_each_kernel_compiles_for_sm90_without_spilling(name):
    kernel, pointers, constants = kernels()[name]
    usage = resources(kernel, pointers, constants, warps=8)
    assert usage["LOCAL"] == 0, usage  # no register spills
    assert usage["REG"] <= 128, usage  # two programs of 8 warps an SM at least
    assert programs_per_sm(usage["REG"], 8) >= 2


def test_programs_per_sm_is_the_register_file_over_a_programs_registers():
    assert programs_per_sm(128, 8) == 2 and programs_per_sm(64, 8) == 4  # 65,536 / (regs x 32 threads x warps)
    assert programs_per_sm(255, 8) == 1 and programs_per_sm(255, 16) == 0
