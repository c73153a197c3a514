"""What one cycle of each draft shape costs against one vanilla decoding step, on the runtime (static cache,
lean forward, CUDA graphs on a GPU), batch 1, with a real prompt length in the cache: the break-even τ.

    python bench/forward_cost.py [--device cpu|cuda] [--prompt 300] [--tokens 1 2 4 8 16 32 61]
                                 [--shapes ngram:3 chain:3 tree:8,8,60] [--reorder on off] [--rounds 3]

A target forward of Q tokens is what verifying a draft of Q-1 nodes costs; drafting is timed on its own (an
untrained drafter of the target's shape: the cost does not depend on the weights). Break-even τ = (drafting +
verification of the shape's block) / one decode step: a method speeds decoding up only when its τ is above it.
Median of `--reps` after warm-up; random token ids; the cache state is left as it was after every timed call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter
from hstap.models import load_target
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from hstap.runtime.target import Runtime


def timed(fn, reps: int, sync) -> float:
    """Median milliseconds of fn() over `reps` calls after two warm-up calls."""
    times = []
    for rep in range(reps + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if rep >= 2:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(model, drafter, shapes: list[DraftShape], args, sync) -> tuple[dict[int, float], dict[str, float], int]:
    """One arm: ms per target forward of each token count, ms of each shape's drafting, and the bytes of the
    projections' oneDNN copies, on a fresh runtime (`HSTAP_CPU_REORDER` as the caller set it)."""
    rt = Runtime(model, batch_size=1, max_len=args.prompt + 512, len_bucket=args.prompt + 1024, max_slots=1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=model.device)
    forward_ms, drafting_ms = {}, {}
    with torch.inference_mode():
        rt.prefill(prompt, torch.ones_like(prompt), 256)
        slot = rt.slot
        for n in sorted(set(args.tokens) | {1} | {s.nodes + 1 for s in shapes}):
            ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)
            depths = torch.arange(n, device=model.device)
            tree = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()  # a chain of n
            step = rt.graph(("forward", n), lambda: rt.block(slot, ids, depths, tree), [])
            forward_ms[n] = timed(step, args.reps, sync)
        for shape in shapes:
            dec = SpecDecoder(rt, shape, drafter if shape.uses_drafter else None)
            st = dec._state(slot)
            dec._start(st, slot, prompt, prompt[:, -1], torch.zeros(1, args.prompt, 3 * model.config.hidden_size,
                                                                     dtype=model.dtype, device=model.device))
            if st.pend_count is not None:
                st.pend_count.fill_(shape.depth + 1)  # drafting after a fully accepted draft
            draft = rt.graph(("draft", dec.tag), lambda: dec._draft(st, slot), dec._saved(st, slot))
            drafting_ms[shape.spec] = timed(draft, args.reps, sync)
    return forward_ms, drafting_ms, rt.lean.reordered_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 61])
    ap.add_argument("--shapes", nargs="+", default=["ngram:3", "chain:3", "tree:8,8,60"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--reorder", nargs="+", choices=["on", "off"], default=["on"],
                    help="arms side by side: the CPU projections with oneDNN's reordered weights (the default, "
                         "hstap.runtime.linear) or without (HSTAP_CPU_REORDER=0); no effect on a GPU")
    ap.add_argument("--rounds", type=int, default=1, help="the arms alternate this many times; each figure is "
                    "the smallest of its rounds' medians (other load on a shared machine only adds time)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_target("smollm2", device=args.device).model
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    shapes = [DraftShape.parse(s) for s in args.shapes]
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, [1, 14, 26], 16384, "x", "x"))
    drafter = drafter.to(device=model.device, dtype=model.dtype).eval()
    arms: dict[str, tuple[dict[int, float], dict[str, float], int]] = {}
    for _ in range(args.rounds):
        for arm in args.reorder:
            os.environ["HSTAP_CPU_REORDER"] = "1" if arm == "on" else "0"
            forward_ms, drafting_ms, extra = measure(model, drafter, shapes, args, sync)
            if arm in arms:  # the smaller of the rounds' medians
                forward_ms = {n: min(ms, arms[arm][0][n]) for n, ms in forward_ms.items()}
                drafting_ms = {k: min(ms, arms[arm][1][k]) for k, ms in drafting_ms.items()}
            arms[arm] = forward_ms, drafting_ms, extra
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"date {datetime.date.today()}, device {dev}, torch {torch.__version__}, dtype {model.dtype}, "
          f"CUDA graphs {args.device.startswith('cuda')}")
    print(f"command: python {' '.join(sys.argv)}")
    for arm, (forward_ms, drafting_ms, extra) in arms.items():
        print(f"\n## reorder {arm} (oneDNN copies: {extra / 2**20:.0f} MiB)\n")
        print("| tokens in the forward | ms | × one token |\n|---:|---:|---:|")
        for n in args.tokens:
            print(f"| {n} | {forward_ms[n]:.2f} | {forward_ms[n] / forward_ms[1]:.2f} |")
        print("\n| method | drafting ms | verification ms | cycle ms | break-even τ |\n|---|---:|---:|---:|---:|")
        for shape in shapes:
            draft, verify = drafting_ms[shape.spec], forward_ms[shape.nodes + 1]
            print(f"| {shape.spec} | {draft:.2f} | {verify:.2f} | {draft + verify:.2f} | "
                  f"{(draft + verify) / forward_ms[1]:.2f} |")


if __name__ == "__main__":
    main()
