"""torch.topk against hstap.topk.block_topk, in the shapes the decoder and the teacher use, side by side.

    python bench/topk_cost.py --device cuda

Each way runs replayed from a CUDA graph (as the tree drafter's expansion does; eager on a CPU), `--repeat` times
after a warm-up, and its mean µs per call is printed with whether its values equal torch.topk's. Shapes: the
tree:8,8,60 drafter's root row (1 × 16,384 fp32, k 8) and its per-depth rows (8 × 16,384, k 8), and an 8B
teacher's prefill (8,192 × 128,256 bf16, k 32; eager, it is not graphed).
"""

from __future__ import annotations

import time

import torch

import harness
from hstap.topk import block_topk
from verify_cost import graphed  # bench/ is the script's directory, first on sys.path

SHAPES = [("tree root", (1, 16384), torch.float32, 8, True), ("tree depth", (8, 16384), torch.float32, 8, True),
          ("8B teacher", (8192, 128256), torch.bfloat16, 32, False)]


def time_call(fn, reps: int, graph: bool) -> float:
    """Mean µs of fn() over reps, replayed from a CUDA graph when `graph` (verify_cost's `graphed`)."""
    call = graphed(fn, graph)
    call()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    sync()
    return 1e6 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = harness.parser(__doc__, repeat=200)
    args = ap.parse_args()
    run = harness.start(args)
    gen = torch.Generator(device=args.device).manual_seed(0)
    print("| rows | shape | k | torch.topk µs | block_topk µs | compiled block_topk µs | values equal |")
    print("|---|---|---:|---:|---:|---:|---|")
    compiled = torch.compile(block_topk, dynamic=False)
    numbers = []
    for name, shape, dtype, k, graph in SHAPES:
        x = torch.randn(*shape, device=args.device, generator=gen).to(dtype)
        reps = args.repeat if graph else max(5, args.repeat // 20)
        ways = {"topk": lambda: x.topk(k, dim=-1), "block": lambda: block_topk(x, k), "compiled": lambda: compiled(x, k)}
        us, figures = {}, {}
        for way, fn in ways.items():
            try:
                figures[way] = time_call(fn, reps, graph and args.device.startswith('cuda'))
                us[way] = f"{figures[way]:.1f}"
            except Exception as exc:  # noqa: BLE001 — a compile that fails here is a figure, not a crash
                us[way] = figures[way] = f"failed ({type(exc).__name__})"
        equal = torch.equal(block_topk(x, k)[0], x.topk(k, dim=-1).values)
        numbers.append({"rows": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "k": k,
                        "us_per_call": figures, "values_equal": equal})
        print(f"| {name} | {' × '.join(map(str, shape))} {str(dtype).removeprefix('torch.')} | {k} | {us['topk']} | "
              f"{us['block']} | {us['compiled']} | {equal} |", flush=True)
    run.finish(numbers)


if __name__ == "__main__":
    main()
