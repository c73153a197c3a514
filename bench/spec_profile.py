"""Where a speculative-decoding cycle's time goes on the device: kernels per cycle, the device's busy share and its
idle gaps, per method, from torch.profiler's kernel timeline over a few MT-bench prompts (batch 1, CUDA graphs).

    python bench/spec_profile.py --drafter runs/gpu/drafter --prompts 4 --shapes chain:3 chain:3@eager tree:8,8,60

bench/spec_decode.py splits a cycle into drafting, verification and "between" with CUDA events; this says what
fills each: how many kernels a cycle launches (a graph replay still pays a few µs per kernel on a model this
small), how much of the wall time the device computes at all, and how the idle time is spread (many small
launch gaps, or a few long waits for the host). Each method runs once untimed first (its graphs are captured
then); the profiled run follows. Prints one table; `--json` adds a line per method; `--top N` adds, per method,
the N kernels that take the most device time per cycle, beside what vanilla spends in each per token (where a
tree's ~370 kernels and ~1.8 ms a cycle over a vanilla step go: its drafting is 1.32 of them, 2026-12-03).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import harness
from hstap.config import torch_dtype
from hstap.drafter.load import load_drafter
from hstap.evaluate.run import load_prompts
from hstap.evaluate.methods import Methods
from hstap.models import load_target
from hstap.runtime.shapes import DraftShape


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start, end) in µs of every device kernel and memory operation the profiler saw, sorted by start."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA:
            out.append((e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3))
    return sorted(out, key=lambda event: event[1])


def kernel_table(events: list[tuple[str, float, float]], cycles: int,
                 width: int = 90) -> dict[str, tuple[float, float]]:
    """{kernel name (first `width` characters): (launches per cycle, device µs per cycle)}, largest time first."""
    per: dict[str, list[float]] = {}
    for name, start, end in events:
        count_time = per.setdefault(name[:width], [0.0, 0.0])
        count_time[0] += 1
        count_time[1] += end - start
    n = max(cycles, 1)
    return dict(sorted(((k, (c / n, t / n)) for k, (c, t) in per.items()), key=lambda item: -item[1][1]))


def timeline(intervals: list[tuple[float, float]]) -> dict:
    """Busy time (the union of the intervals), span, and the idle gaps between busy stretches, all in µs."""
    busy, gaps, end = 0.0, [], None
    for start, stop in intervals:
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    return {"kernels": len(intervals), "busy_us": busy, "span_us": span, "gaps": gaps}


def main() -> None:
    ap = harness.parser(__doc__, device="cuda")
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--prompts", type=int, default=4, help="MT-bench first turns profiled per method")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shapes", nargs="+", default=["ngram:3", "chain:3", "chain:3@eager", "tree:8,8,60"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=int, default=0, help="per method, the N kernels with the most device time a cycle")
    args = ap.parse_args()
    if not args.device.startswith("cuda"):
        ap.error(f"--device {args.device}: needs a CUDA device (it reads the device's kernel timeline)")
    run = harness.start(args)
    target = load_target("smollm2", device=args.device, dtype=torch_dtype(args.dtype))
    shapes = [DraftShape.parse(s) for s in args.shapes]
    drafter = load_drafter(args.drafter, target) if any(s.uses_drafter for s in shapes) else None
    prompts = load_prompts("mt-bench", target.tokenizer, args.prompts)
    longest = max(len(p.ids) for p in prompts) + args.max_new_tokens
    methods = Methods(target.model, drafter, 1, longest, shapes)
    stops = set(target.stop_ids)
    print(f"{len(prompts)} MT-bench prompts x {args.max_new_tokens} new tokens, batch 1, {args.dtype}")
    print("| method | cycles | ms per cycle | kernels per cycle | device busy | idle gaps per cycle | median gap µs "
          "| gaps ≥ 50 µs: count, µs per cycle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    tables, rows = {}, []
    for shape in [None, *shapes]:
        name = "vanilla" if shape is None else shape.spec
        for p in prompts:  # untimed: graphs captured, kernels compiled
            methods.run(shape, [p.ids], 8, stops)
        torch.cuda.synchronize()
        cycles = 0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for p in prompts:
                gen = methods.run(shape, [p.ids], args.max_new_tokens, stops)[0]
                cycles += gen.verify_forwards
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = kernel_events(prof)
        tables[name] = kernel_table(events, cycles)
        t = timeline([(start, end) for _, start, end in events])
        gaps = sorted(t["gaps"])
        long = [g for g in gaps if g >= 50]
        row = {"method": name, "cycles": cycles, "ms_per_cycle": 1000 * wall / max(cycles, 1),
               "kernels_per_cycle": t["kernels"] / max(cycles, 1), "busy": t["busy_us"] / max(t["span_us"], 1),
               "gaps_per_cycle": len(gaps) / max(cycles, 1), "median_gap_us": gaps[len(gaps) // 2] if gaps else 0,
               "long_gaps": len(long), "long_gap_us_per_cycle": sum(long) / max(cycles, 1)}
        print(f"| {name} | {cycles} | {row['ms_per_cycle']:.2f} | {row['kernels_per_cycle']:.0f} | "
              f"{100 * row['busy']:.0f} % | {row['gaps_per_cycle']:.0f} | {row['median_gap_us']:.1f} | "
              f"{len(long)}, {row['long_gap_us_per_cycle']:.0f} |", flush=True)
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    run.finish({"methods": rows, "top_kernels": print_top_kernels(tables, args.top) if args.top else {}})


def print_top_kernels(tables: dict[str, dict[str, tuple[float, float]]], top: int) -> dict[str, list[dict]]:
    """Per method, its `top` kernels by device time a cycle beside vanilla's a token: printed, and returned."""
    for name, table in tables.items():
        if name == "vanilla":
            continue
        print(f"\n{name}: the {top} kernels with the most device time a cycle (vanilla's a token beside)\n\n"
              "| kernel | launches a cycle | µs a cycle | vanilla launches | vanilla µs |\n|---|---:|---:|---:|---:|")
        for kernel, (count, us) in list(table.items())[:top]:
            v_count, v_us = tables["vanilla"].get(kernel, (0.0, 0.0))
            print(f"| `{kernel}` | {count:.1f} | {us:.1f} | {v_count:.1f} | {v_us:.1f} |")
    return {name: [{"kernel": k, "launches_per_cycle": c, "us_per_cycle": us} for k, (c, us) in
                   list(table.items())[:top]] for name, table in tables.items()}


if __name__ == "__main__":
    main()
