"""The hand-written Triton kernels compiled for an H200 (sm_90) on any machine, no GPU: registers, spills and
shared memory a thread block, read from each cubin by the cuobjdump Triton's wheel ships.

    python bench/kernel_resources.py                 # the kernels as hstap train launches them (heads of 128)
    python bench/kernel_resources.py --block 32      # the merge kernels at another positions-per-program

A kernel that only moves bytes needs loads in flight: registers decide how many programs an SM holds (65,536 a
SM / (registers × threads)). tests/train/test_kernels_compile.py holds each kernel to no spills and ≤ 128
registers a thread at 8 warps, through `resources` here.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile

import triton

from hstap.train import head_kernel, merge_kernel

BF16, FP32, I64 = "*bf16", "*fp32", "*i64"
REGISTERS_PER_SM = 65536


def resources(kernel, pointers: dict[str, str], constants: dict, warps: int) -> dict[str, int]:
    """Compile `kernel` (a triton.jit function) for sm_90 with `constants` → its cubin's resource usage (REG, LOCAL,
    SHARED, ...). Arguments not in `pointers` or `constants` are i32, `scale` fp32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "scale" else "i32")
                 for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = next(line for line in out.splitlines() if "REG:" in line).split()
    return {k: int(v) for k, v in (field.split(":") for field in fields if ":" in field and "[" not in field)}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=merge_kernel.BLOCK_S, help="the merge kernels' positions a program")
    ap.add_argument("--warps", type=int, default=8)
    args = ap.parse_args()
    print(f"sm_90, Triton {triton.__version__}, {args.warps} warps, merge kernels at {args.block} positions a program")
    print(f"{'kernel':24s} {'registers':>9s} {'spilled':>8s} {'shared':>7s} {'programs/SM':>11s}")
    for name, (kernel, pointers, constants) in kernels(args.block).items():
        use = resources(kernel, pointers, constants, args.warps)
        per_sm = REGISTERS_PER_SM // (use["REG"] * 32 * args.warps)
        print(f"{name:24s} {use['REG']:9d} {use['LOCAL']:8d} {use['SHARED']:7d} {per_sm:11d}")


if __name__ == "__main__":
    main()
