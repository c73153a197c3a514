"""What a CPU forward's projections cost by row count, three ways: PyTorch's default (`F.linear`, MKL), oneDNN
with the weight reordered once (what `hstap.runtime.linear.Projection` uses from four rows on), and MKL's own
packed weights (`_mkl_linear`, one pack per row count). The weights have SmolLM2's shapes (fused q/k/v, o,
gate/up, down per layer, then the lm_head), are random and distinct, so each pass streams them from memory as a
decoding forward does.

    python bench/cpu_gemm.py [--rows 1 2 3 4 5 8 16 61 300] [--repeat 11] [--no-mkl-packed] [--reorder-hint 4]
                             [--threads-busy]

Median ms of one pass over all projections, per row count; the arms alternate in one process. `--reorder-hint`:
the row count oneDNN's copy is laid out for (the runtime's: `REORDERED_FROM_ROWS`). `--threads-busy`: after each
arm's ms, how many of the process's threads did its work ("/2": both of two), from their CPU time in
/proc/self/task (Linux); a product that runs on one thread reads the weights with one core's bandwidth, whatever
the machine's thread count; run it with OMP_WAIT_POLICY=PASSIVE, or idle OpenMP threads spinning count as busy.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

import harness
from hstap.runtime.linear import REORDERED_FROM_ROWS


def smollm2_shapes() -> list[tuple[int, int]]:
    """(out, in) of SmolLM2-135M's projections as the runtime fuses them: 30 layers, then the lm_head."""
    hidden, inner, heads, kv_heads, layers, vocab = 576, 1536, 9, 3, 30, 49152
    head_dim = hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, hidden), (2 * inner, hidden), (hidden, inner)]
    return layer * layers + [(vocab, hidden)]


def threads_busy(fn, reps: int) -> str:
    """How many threads did `fn`'s work over `reps` calls: those with at least a fifth of the busiest one's CPU
    time, out of every thread that ran any ("1/2": one of two)."""
    def ticks() -> dict[str, int]:
        out = {}
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[task] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    before = ticks()
    for _ in range(reps):
        fn()
    spent = [t - before.get(task, 0) for task, t in ticks().items()]
    ran = [t for t in spent if t > 0]
    return f"{sum(t >= max(spent) / 5 for t in ran)}/{max(len(ran), torch.get_num_threads())}"


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up: the primitives are made, the pages touched
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = harness.parser(__doc__, device=None, repeat=11)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 61, 300])
    ap.add_argument("--no-mkl-packed", action="store_true", help="skip MKL's packed arm (3.7x the weights' bytes)")
    ap.add_argument("--reorder-hint", type=int, default=REORDERED_FROM_ROWS)
    ap.add_argument("--threads-busy", action="store_true", help="also how many threads each arm's products ran on")
    args = ap.parse_args()
    run = harness.start(args)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) for out, inp in smollm2_shapes()]
    mkldnn = torch.ops.mkldnn
    reordered = [mkldnn._reorder_linear_weight(w, args.reorder_hint) for w in weights]
    mb = sum(w.numel() * 4 for w in weights) / 1e6
    print(f"fp32, {len(weights)} projections, {mb:.0f} MB of weights, oneDNN's copy "
          f"laid out for {args.reorder_hint} rows")
    arms = ["F.linear (MKL)", "oneDNN, reordered once"] + ([] if args.no_mkl_packed else ["MKL packed per row count"])
    print(f"\n| rows | {' | '.join(arms)} |\n|---:|" + "---:|" * len(arms))
    packed_mb, table = {}, []
    with torch.inference_mode():
        for m in args.rows:
            xs = [torch.randn(m, w.shape[1], generator=generator) for w in weights]
            arms_fn = [lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights)],
                       lambda xs=xs: [mkldnn._linear_pointwise(x, r, None, "none", [], "") for x, r in zip(xs, reordered)]]
            row = [median_ms(fn, args.repeat) for fn in arms_fn]
            if not args.no_mkl_packed:  # its pack is used only at exactly the row count it was made for
                packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
                packed_mb[m] = sum(p.numel() * p.element_size() for p in packed) / 1e6
                row.append(median_ms(lambda xs=xs, packed=packed, m=m: [torch.ops.mkl._mkl_linear(x, p, w, None, m)
                                         for x, p, w in zip(xs, packed, weights)], args.repeat))
                del packed
            cells = [f"{ms:.1f}" for ms in row]
            entry = {"rows": m, "ms": dict(zip(arms, row))}
            if args.threads_busy:  # the F.linear and oneDNN arms only
                busy = [threads_busy(fn, args.repeat) for fn in arms_fn]
                cells[:2] = [f"{c} ({b})" for c, b in zip(cells, busy)]
                entry["threads_busy"] = dict(zip(arms, busy))
            table.append(entry)
            print(f"| {m} | " + " | ".join(cells) + " |")
    if packed_mb:
        print("\nMKL's packs, MB per row count: " + ", ".join(f"{m}: {v:.0f}" for m, v in packed_mb.items()))
    run.finish({"weights_mb": mb, "by_rows": table, "mkl_pack_mb": packed_mb})


if __name__ == "__main__":
    main()
