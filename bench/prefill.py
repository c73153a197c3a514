"""The runtime's prefill paths side by side: transformers' forward (`Runtime(prefill="model")`, a DynamicCache
copied into the static cache, hooks for the aux layers), LeanLlama's eager forward (`prefill="lean"`, written in
place; `prefill_bucket=0`), and that forward replayed from a CUDA graph per padded width ("lean+graph", the
default on CUDA: the batch left-padded to a multiple of PREFILL_BUCKET), same prompts, same process, with and
without the drafter's aux layers.

    python bench/prefill.py [--device cpu|cuda] [--lengths 64 256 1024] [--batch 1] [--repeat 10] [--threads 2]
    python bench/prefill.py --device cuda --lengths 128 512 2048 --batch 1 8 --repeat 20   # the H200 recipe's

Prompts are random token ids of `--lengths` tokens; every other row is a quarter shorter, left-padded (the padding
mask is exercised, as in real batches). A call is `rt.prefill(ids, mask, 256[, aux_layers])`, what the
speculative decoder runs per batch. Median of `--repeat` after `--warmup` rounds, the paths alternating call by call
(a shared machine's drift hits both alike); ms per prompt = ms per call / batch. The graph runtime has exactly
`rows` rows (a graph runs all of its runtime's rows); where it would not take the graph path (a CPU: no graphs;
rows x bucket past GRAPH_PREFILL_TOKENS) or its capture fails (out of memory), its column says why instead.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

import harness
from hstap.errors import first_line
from hstap.models import load_target
from hstap.runtime.target import GRAPH_PREFILL_TOKENS, PREFILL_BUCKET, Runtime

AUX_LAYERS = [1, 14, 26]  # the EAGLE-3 drafter's taps on SmolLM2 (30 layers)
NEW_TOKENS = 256


def alternating_medians(calls: dict[str, Callable[[], object]], reps: int, warmup: int,
                        sync: Callable[[], None]) -> dict[str, float]:
    """Median milliseconds of each call over `reps` rounds after `warmup` rounds; one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + warmup):
        for name, call in calls.items():
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def padded_batch(rows: int, length: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, length) random ids and a left-padding mask: odd rows are a quarter shorter."""
    ids = torch.randint(0, vocab, (rows, length), device=device)
    mask = torch.ones_like(ids)
    mask[1::2, : length // 4] = 0
    return ids, mask


def main() -> None:
    ap = harness.parser(__doc__, repeat=10, warmup=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="prompt tokens per row")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="rows per prefill call")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    args = ap.parse_args()
    if min(args.lengths) < 1 or min(args.batch) < 1 or args.repeat < 1:
        sys.exit("prefill.py: error: --lengths, --batch and --repeat must be positive")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    run = harness.start(args)
    torch.manual_seed(0)
    model = load_target("smollm2", device=args.device).model
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    longest = -(-max(args.lengths) // PREFILL_BUCKET) * PREFILL_BUCKET + NEW_TOKENS  # the widest bucket fits
    runtimes = {"model": Runtime(model, batch_size=max(args.batch), max_len=longest, len_bucket=longest,
                                 max_slots=1, prefill="model"),
                "lean": Runtime(model, batch_size=max(args.batch), max_len=longest, len_bucket=longest,
                                max_slots=1, prefill_bucket=0)}
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            graphed: Runtime | None = Runtime(model, batch_size=batch, max_len=longest, len_bucket=longest,
                                              max_slots=1)  # one slot: its graphs serve every length below
            for length in args.lengths:
                ids, mask = padded_batch(batch, length, model.config.vocab_size, args.device)
                for aux in ((), AUX_LAYERS):
                    calls = {path: (lambda rt=rt, aux=aux: rt.prefill(ids, mask, NEW_TOKENS, aux_layers=aux))
                             for path, rt in runtimes.items()}
                    why = why_eager(graphed, length, batch)
                    if not why:
                        why = try_graph(graphed, ids, mask, aux, sync)
                        if why:
                            graphed = None  # a failed capture may leave its slot unusable: the next rows go eager
                    if not why:
                        calls["lean+graph"] = lambda rt=graphed, aux=aux: rt.prefill(ids, mask, NEW_TOKENS,
                                                                                     aux_layers=aux)
                    ms = alternating_medians(calls, args.repeat, args.warmup, sync)
                    rows.append((length, batch, aux, {k: v / batch for k, v in ms.items()}, why))
    print(f"dtype {model.dtype}")
    print("| prompt tokens | rows | aux layers | model ms/prompt | lean ms/prompt | lean+graph ms/prompt | "
          "model / lean | lean / lean+graph |\n|---:|---:|---|---:|---:|---:|---:|---:|")
    for length, batch, aux, ms, why in rows:
        graph = f"{ms['lean+graph']:.2f}" if "lean+graph" in ms else f"— ({why})"
        ratio = f"{ms['lean'] / ms['lean+graph']:.2f}" if "lean+graph" in ms else "—"
        print(f"| {length} | {batch} | {','.join(map(str, aux)) or '-'} | {ms['model']:.2f} | {ms['lean']:.2f} | "
              f"{graph} | {ms['model'] / ms['lean']:.2f} | {ratio} |")
    run.finish([{"prompt_tokens": length, "rows": batch, "aux_layers": list(aux), "ms_per_prompt": ms,
                 "graph": why or "replayed"} for length, batch, aux, ms, why in rows])


def why_eager(rt: Runtime | None, length: int, batch: int) -> str:
    """Why the graph runtime would not replay a graph for this prefill ("" when it would)."""
    if rt is None:
        return "eager: an earlier capture failed"
    if rt.graph_bucket(length, NEW_TOKENS) is not None:
        return ""
    if not (rt.cuda_graphs or rt.rehearse):
        return "no CUDA graphs on a CPU: it is the lean column"
    bucket = -(-length // rt.prefill_bucket) * rt.prefill_bucket
    if batch * bucket > GRAPH_PREFILL_TOKENS:
        return f"eager: {batch} rows x {bucket} columns past GRAPH_PREFILL_TOKENS {GRAPH_PREFILL_TOKENS}"
    return f"eager: a {bucket}-column bucket does not fit the slot"


def try_graph(rt: Runtime, ids: torch.Tensor, mask: torch.Tensor, aux: list[int], sync: Callable[[], None]) -> str:
    """Capture the graph of this prefill once (outside the timing); → "" or why it failed (then eager)."""
    try:
        rt.prefill(ids, mask, NEW_TOKENS, aux_layers=aux)
        sync()
        return ""
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # a capture out of memory must not end the bench
        rt.slots.clear()
        rt.slot = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"eager: the capture failed ({first_line(e)[:80]})"


if __name__ == "__main__":
    main()
