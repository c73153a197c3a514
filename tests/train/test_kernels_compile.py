"""The hand-written Triton kernels compile for an H200 (sm_90) here, without a GPU: Triton's compiler and the
ptxas in its wheel build each kernel's cubin as a CUDA process would, which the CPU interpreter (the other kernel
tests) never does (bench/kernel_resources.py). Each must fit its registers without spilling to local memory, and
leave room for at least two programs an SM (≤ 128 registers a thread at 8 warps), since they only move bytes and
need loads in flight."""

from __future__ import annotations

import os

import pytest

from tests.bench_scripts import bench_script

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice of a default
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton wheel ships no cuobjdump")
@pytest.mark.parametrize("name", ["merge forward", "merge backward, rows", "merge backward, keys", "head loss"])
def test_each_kernel_compiles_for_sm90_without_spilling(name):
    script = bench_script("kernel_resources")
    kernel, pointers, constants = script.kernels()[name]
    usage = script.resources(kernel, pointers, constants, warps=8)
    assert usage["LOCAL"] == 0, usage  # no register spills
    assert usage["REG"] <= 128, usage  # two programs of 8 warps an SM at least
