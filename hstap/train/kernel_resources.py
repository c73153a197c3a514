"""What the hand-written Triton kernels (hstap.train.merge_kernel, hstap.train.head_kernel) cost a GPU's SM,
read without a GPU: each kernel is compiled for an H200 (sm_90) by Triton's own compiler and ptxas, and its
cubin's registers, spills and shared memory are read with the cuobjdump that Triton's wheel ships.

    usage = resources(*kernels()["head loss"], warps=8)      # {"REG": 64, "LOCAL": 0, "SHARED": 0, ...}
    python bench/kernel_resources.py                          # the table, every kernel

Why it lives in the package: the kernels only move bytes, so they need loads in flight, and registers decide how
many programs an SM holds (REGISTERS_PER_SM / (registers × 32 × warps)). `kernels()` is the launch configuration
the trainer uses, so a change to a kernel or to its constants is held to its register budget by the CPU test
suite (tests/train/test_kernel_resources.py); the CPU interpreter the other kernel tests run never compiles one.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import tempfile

from hstap.train import head_kernel, merge_kernel

BF16, FP32, I64 = "*bf16", "*fp32", "*i64"
REGISTERS_PER_SM = 65536  # sm_90
SM90_WARP = 32


def cuobjdump_path() -> str:
    """The cuobjdump inside Triton's wheel (absent from some wheels: callers check it exists)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(kernel, pointers: dict[str, str], constants: dict, warps: int) -> dict[str, int]:
    """Compile `kernel` (a triton.jit function) for sm_90 with `constants` → its cubin's resource usage (REG, LOCAL,
    SHARED, ...). Arguments not in `pointers` or `constants` are i32, `scale` fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "scale" else "i32")
                 for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, SM90_WARP), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = next(line for line in out.splitlines() if "REG:" in line).split()
    return {k: int(v) for k, v in (field.split(":") for field in fields if ":" in field and "[" not in field)}


def programs_per_sm(registers: int, warps: int) -> int:
    """How many programs of `warps` warps an SM holds when each thread needs `registers` registers."""
    return REGISTERS_PER_SM // (registers * SM90_WARP * warps)


def kernels(block: int = merge_kernel.BLOCK_S) -> dict[str, tuple]:
    """name → (kernel, pointer types, constexprs) as the 8B shape launches them (heads of 128)."""
    merge = dict(HD=128, HD_P2=128, BLOCK=block)
    return {
        "merge forward": (merge_kernel._fwd, dict(Q=BF16, O=BF16, LSE=FP32, KD=BF16, VD=BF16, OUT=BF16, TOT=FP32),
                          merge),
        "merge backward, rows": (merge_kernel._bwd_rows,
                                 dict(Q=BF16, DO=BF16, R=BF16, TOT=FP32, KD=BF16, VD=BF16, O=BF16, LSE=FP32, DQ=BF16,
                                      DOUT=BF16, DLSE=FP32, DD=FP32, P=FP32), {**merge, "PREFIX": True}),
        "merge backward, keys": (merge_kernel._bwd_keys, dict(Q=BF16, DO=BF16, DD=FP32, P=FP32, DK=BF16, DV=BF16),
                                 merge),
        "head loss": (head_kernel._head, dict(X=BF16, IDS=I64, P=FP32, SCALE=FP32, LOSS=FP32, ARGMAX=I64,
                                              GRAD=BF16), dict(BLOCK=head_kernel.BLOCK_V, K_P2=32, GRADS=True)),
    }
