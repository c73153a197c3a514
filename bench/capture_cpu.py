"""Prefill throughput with and without the tap, side by side in one run, on the CPU.

    .venv/bin/python bench/capture_cpu.py [--samples 64] [--batch-tokens 4096] [--repeat 3] [--threads N]

Runs real ShareGPT conversations through SmolLM2 (fp32) in identical padded batches, alternating plain prefill
and tapped prefill (3 layers + top-32 teacher, bf16 storage, writer thread handing samples to a sink that keeps
them in memory, so disk speed is not measured here). Prints tokens/s of each and the tap's overhead.
"""

from __future__ import annotations

import statistics
import time

import torch

import harness
from hstap.capture.hf import hf_taps
from hstap.capture.run import _to_model_inputs, make_batches
from hstap.capture.tap import Tap
from hstap.config import TeacherSpec
from hstap.data import SkipReport, render_all
from hstap.metrics import tokens_per_second
from hstap.models import load_target


def main() -> None:
    ap = harness.parser(__doc__, device=None, repeat=3)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = harness.start(args)

    target = load_target("smollm2")
    samples = render_all("sharegpt", target.tokenizer, SkipReport(), max_tokens=args.max_tokens, limit=args.samples)
    batches = [_to_model_inputs(b, target.tokenizer.pad_token_id, "cpu")
               for b in make_batches(samples, args.batch_tokens)]
    tokens = sum(sum(layout.lengths) for _, layout in batches)
    layers = [1, 14, 26]

    def plain() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for inputs, _ in batches:
                target.model(**inputs, use_cache=False)
        return time.perf_counter() - t0

    def tapped() -> float:
        kept = []
        tap = Tap({f"hidden.{k}" for k in layers} | {"teacher"}, sink=lambda s, t: kept.append(s),
                  teacher=TeacherSpec(kind="topk", k=32), hidden_size=target.hidden_size)
        t0 = time.perf_counter()
        with hf_taps(target.model, tap, layers), torch.inference_mode():
            for inputs, layout in batches:
                tap.begin(layout)
                target.model(**inputs, use_cache=False)
                tap.end()
        report = tap.close()
        assert report.errors == 0 and len(kept) == len(samples), report.summary()
        return time.perf_counter() - t0

    plain()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "tapped": []}
    for _ in range(args.repeat):
        times["plain"].append(plain())
        times["tapped"].append(tapped())
    rate = {k: tokens_per_second(tokens, statistics.median(v)) for k, v in times.items()}
    print(f"{len(samples)} ShareGPT samples, {tokens} tokens, {len(batches)} batches of <= {args.batch_tokens} "
          f"padded tokens, median of {args.repeat}")
    for k, v in rate.items():
        print(f"{k:>7}: {v:8.0f} tok/s")
    overhead = 1 - rate["tapped"] / rate["plain"]
    print(f"tap overhead: {100 * overhead:.1f}%")
    run.finish({"samples": len(samples), "tokens": tokens, "batches": len(batches), "tokens_per_s": rate,
                "tap_overhead": overhead})


if __name__ == "__main__":
    main()
