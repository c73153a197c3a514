"""Continuous batching against static batches: the Engine answering the same real requests both ways, one run.

    python bench/continuous.py [--device cpu|cuda] [--batch 16] [--prompts 64] [--new 128] [--temperature 0 0.7]
    python bench/continuous.py --device cuda --batch 256 --prompts 2048 --new 384      # the synth recipe's size

Requests are real ShareGPT first turns rendered as synth renders them (at most --max-prompt tokens), answered
with their natural stops (an answer ends at the end-of-turn token or at --new), all submitted at once, as
`hstap synth` keeps its queue full. `static` is `Engine(continuous=False)`: batches of --batch taken in arrival
order, each run until its longest row ends. `continuous` is the default Engine: a row is refilled as soon as its
answer ends. Both decode on the same runtime kind (CUDA graphs on a GPU); greedy answers are identical (checked).
Reported per mode: wall seconds, answers/s, generated tokens/s (stop tokens included, as synth counts them), and
the mean and 90th-percentile time from submission to answer; one untimed warm-up of each first (graph capture).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future

import torch

import harness
from hstap.data import open_source, render_prompt
from hstap.metrics import tokens_per_second
from hstap.models import load_target
from hstap.runtime.engine import Engine, Request


def prompts(tokenizer, n: int, cap: int) -> list[list[int]]:
    out = []
    for conv in open_source("sharegpt"):
        if len(out) == n:
            break
        ids = render_prompt(conv.messages[:1], tokenizer)
        if len(ids) <= cap:
            out.append(ids)
    return out


def run(engine: Engine, requests: list[Request]) -> dict:
    start = time.perf_counter()
    finished: dict[int, float] = {}

    def stamp(k: int):
        return lambda _: finished.__setitem__(k, time.perf_counter() - start)

    futures: list[Future] = []
    for k, request in enumerate(requests):
        future = engine.submit(request)
        future.add_done_callback(stamp(k))
        futures.append(future)
    gens = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    waits = sorted(finished.values())
    tokens = sum(g.completion_tokens for g in gens)
    return dict(seconds=seconds, answers_per_s=len(gens) / seconds, tok_s=tokens_per_second(tokens, seconds),
                tokens=tokens, mean_wait=statistics.fmean(waits), p90_wait=waits[int(0.9 * (len(waits) - 1))],
                answers=[g.tokens for g in gens], stopped=sum(g.finish_reason == "stop" for g in gens))


def main() -> None:
    ap = harness.parser(__doc__, device="cpu")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on a CPU")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="max new tokens per answer")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt kept, in tokens")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    args = ap.parse_args()
    bench_run = harness.start(args)
    dtype = {None: None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = load_target("smollm2", device=args.device, dtype=dtype)
    ps = prompts(target.tokenizer, args.prompts, args.max_prompt)
    print(f"{len(ps)} ShareGPT first turns (≤ {args.max_prompt} tokens), batch {args.batch}, "
          f"≤ {args.new} new tokens", flush=True)
    engines = {"static": Engine(target, max_batch=args.batch, continuous=False),
               "continuous": Engine(target, max_batch=args.batch, continuous=True)}
    numbers = []
    try:
        for engine in engines.values():  # warm-up: graphs captured, kernels chosen
            engine.generate([Request(p, 8) for p in ps[:args.batch]])
        print("\n| T | mode | wall s | answers/s | tok/s | ended by a stop | mean wait s | p90 wait s | speedup |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for temperature in args.temperature:
            requests = [Request(p, args.new, temperature=temperature, seed=k) for k, p in enumerate(ps)]
            results = {mode: run(engine, requests) for mode, engine in engines.items()}
            same = None
            if temperature == 0:
                same = sum(a == b for a, b in zip(results["static"]["answers"], results["continuous"]["answers"]))
                print(f"(greedy: {same}/{len(ps)} answers identical in both modes)", flush=True)
            for mode, r in results.items():
                speedup = r["tok_s"] / results["static"]["tok_s"]
                numbers.append({"temperature": temperature, "mode": mode, "speedup": speedup, "identical": same,
                                **{k: v for k, v in r.items() if k != "answers"}})
                print(f"| {temperature:g} | {mode} | {r['seconds']:.1f} | {r['answers_per_s']:.2f} | {r['tok_s']:.0f} "
                      f"| {r['stopped']}/{len(ps)} | {r['mean_wait']:.1f} | {r['p90_wait']:.1f} | {speedup:.2f}× |",
                      flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    bench_run.finish({"prompts": len(ps), "rows": numbers})


if __name__ == "__main__":
    main()
