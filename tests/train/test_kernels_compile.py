"""The hand-written Triton kernels compile for an H200 (sm_90) here, without a GPU: Triton's compiler and the
ptxas in its wheel build each kernel's cubin as a CUDA process would, which the CPU interpreter (the other kernel
tests) never does. Each must fit its registers without spilling to local memory, and leave room for at least two
programs an SM (≤ 128 registers a thread at 8 warps), since they only move bytes and need loads in flight."""

from __future__ import annotations

import inspect
import os
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice of a default

from hstap.compiling import tl  # noqa: E402
from hstap.train import head_kernel, merge_kernel  # noqa: E402

BF16, FP32, I64 = "*bf16", "*fp32", "*i64"


def _resources(kernel, pointers: dict[str, str], constants: dict, warps: int) -> dict[str, int]:
    """Compile `kernel` for sm_90 → its cubin's resource usage (REG, LOCAL, SHARED...) read by cuobjdump."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "scale" else "i32")
                 for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("this Triton wheel ships no cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = next(line for line in out.splitlines() if "REG:" in line).split()
    return {k: int(v) for k, v in (field.split(":") for field in fields if ":" in field and "[" not in field)}


MERGE = dict(HD=128, HD_P2=128, BLOCK=merge_kernel.BLOCK_S)  # the 8B shape's heads
KERNELS = {
    "merge forward": (merge_kernel._fwd, dict(Q=BF16, O=BF16, LSE=FP32, KD=BF16, VD=BF16, OUT=BF16, TOT=FP32), MERGE),
    "merge backward, rows": (merge_kernel._bwd_rows, dict(Q=BF16, DO=BF16, R=BF16, TOT=FP32, KD=BF16, VD=BF16, O=BF16,
                                                          LSE=FP32, DQ=BF16, DOUT=BF16, DLSE=FP32, DD=FP32, P=FP32),
                             {**MERGE, "PREFIX": True}),
    "merge backward, keys": (merge_kernel._bwd_keys, dict(Q=BF16, DO=BF16, DD=FP32, P=FP32, DK=BF16, DV=BF16), MERGE),
    "head loss": (head_kernel._head, dict(X=BF16, IDS=I64, P=FP32, SCALE=FP32, LOSS=FP32, ARGMAX=I64, GRAD=BF16),
                  dict(BLOCK=head_kernel.BLOCK_V, K_P2=32, GRADS=True)),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_each_kernel_compiles_for_sm90_without_spilling(name):
    assert tl is not None
    kernel, pointers, constants = KERNELS[name]
    usage = _resources(kernel, pointers, constants, warps=8)
    assert usage["LOCAL"] == 0, usage  # no register spills
    assert usage["REG"] <= 128, usage  # two programs of 8 warps an SM at least
