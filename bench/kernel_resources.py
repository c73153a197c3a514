"""The hand-written Triton kernels compiled for an H200 (sm_90) on any machine, no GPU: registers, spills and
shared memory a thread block, read from each cubin by the cuobjdump Triton's wheel ships.

    python bench/kernel_resources.py                 # the kernels as hstap train launches them (heads of 128)
    python bench/kernel_resources.py --block 32      # the merge kernels at another positions-per-program

A kernel that only moves bytes needs loads in flight: registers decide how many programs an SM holds (65,536 a
SM / (registers × threads)). tests/train/test_kernel_resources.py holds each kernel to no spills and ≤ 128
registers a thread at 8 warps, through `hstap.train.kernel_resources`, which this table prints.
"""

from __future__ import annotations

import triton

import harness
from hstap.train import merge_kernel
from hstap.train.kernel_resources import kernels, programs_per_sm, resources


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--block", type=int, default=merge_kernel.BLOCK_S, help="the merge kernels' positions a program")
    ap.add_argument("--warps", type=int, default=8)
    args = ap.parse_args()
    run = harness.start(args)
    print(f"sm_90, Triton {triton.__version__}, {args.warps} warps, merge kernels at {args.block} positions a program")
    print(f"{'kernel':24s} {'registers':>9s} {'spilled':>8s} {'shared':>7s} {'programs/SM':>11s}")
    numbers = {}
    for name, (kernel, pointers, constants) in kernels(args.block).items():
        use = resources(kernel, pointers, constants, args.warps)
        per_sm = programs_per_sm(use["REG"], args.warps)
        numbers[name] = {**use, "programs_per_sm": per_sm}
        print(f"{name:24s} {use['REG']:9d} {use['LOCAL']:8d} {use['SHARED']:7d} {per_sm:11d}")
    run.finish({"triton": triton.__version__, "kernels": numbers})


if __name__ == "__main__":
    main()
