"""The runtime's two prefill paths side by side: transformers' forward (`Runtime(prefill="model")`, a DynamicCache
copied into the static cache, hooks for the aux layers) against LeanLlama's (`prefill="lean"`, written in place),
same prompts, same process, with and without the drafter's aux layers.

    python bench/prefill.py [--device cpu|cuda] [--lengths 64 256 1024] [--batch 1] [--reps 10] [--threads 2]
    python bench/prefill.py --device cuda --lengths 128 512 2048 --batch 1 8 --reps 20   # the H200 recipe's

Prompts are random token ids of `--lengths` tokens; every other row is a quarter shorter, left-padded (the padding
mask is exercised, as in real batches). A call is `rt.prefill(ids, mask, 256[, aux_layers])`, what the
speculative decoder runs per batch. Median of `--reps` after two warm-ups, the two paths alternating call by call
(a shared machine's drift hits both alike); ms per prompt = ms per call / batch.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from hstap.models import load_target
from hstap.runtime.target import PREFILL_PATHS, Runtime

AUX_LAYERS = [1, 14, 26]  # the EAGLE-3 drafter's taps on SmolLM2 (30 layers)
NEW_TOKENS = 256


def alternating_medians(calls: dict[str, Callable[[], object]], reps: int,
                        sync: Callable[[], None]) -> dict[str, float]:
    """Median milliseconds of each call over `reps` rounds after two warm-up rounds; one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 2):
        for name, call in calls.items():
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def padded_batch(rows: int, length: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, length) random ids and a left-padding mask: odd rows are a quarter shorter."""
    ids = torch.randint(0, vocab, (rows, length), device=device)
    mask = torch.ones_like(ids)
    mask[1::2, : length // 4] = 0
    return ids, mask


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="prompt tokens per row")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="rows per prefill call")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    args = ap.parse_args()
    if min(args.lengths) < 1 or min(args.batch) < 1 or args.reps < 1:
        sys.exit("prefill.py: error: --lengths, --batch and --reps must be positive")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_target("smollm2", device=args.device).model
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    longest = max(args.lengths) + NEW_TOKENS
    runtimes = {path: Runtime(model, batch_size=max(args.batch), max_len=longest, len_bucket=longest, max_slots=1,
                              prefill=path) for path in PREFILL_PATHS}
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            for length in args.lengths:
                ids, mask = padded_batch(batch, length, model.config.vocab_size, args.device)
                for aux in ((), AUX_LAYERS):
                    calls = {path: (lambda rt=rt, aux=aux: rt.prefill(ids, mask, NEW_TOKENS, aux_layers=aux))
                             for path, rt in runtimes.items()}
                    ms = alternating_medians(calls, args.reps, sync)
                    rows.append((length, batch, aux, ms["model"] / batch, ms["lean"] / batch))
    dev = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{cpu_name()}, {torch.get_num_threads()} threads"
    print(f"date {datetime.date.today()}, device {dev}, torch {torch.__version__}, dtype {model.dtype}")
    print(f"command: python {' '.join(sys.argv)}")
    print("| prompt tokens | rows | aux layers | model ms/prompt | lean ms/prompt | model / lean |\n"
          "|---:|---:|---|---:|---:|---:|")
    for length, batch, aux, model_ms, lean_ms in rows:
        print(f"| {length} | {batch} | {','.join(map(str, aux)) or '-'} | {model_ms:.2f} | {lean_ms:.2f} | "
              f"{model_ms / lean_ms:.2f} |")


if __name__ == "__main__":
    main()
