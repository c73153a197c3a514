"""Cost of one target forward against the number of tokens it carries (batch 1, a KV cache of a real prompt
length): what a verification of a chain or tree costs relative to one vanilla decoding step.

    python bench/forward_cost.py [--device cpu|cuda] [--prompt 300] [--tokens 1 2 4 8 16 32 61]

Median of `--reps` forwards after a warm-up; the cache is cut back to the prompt after each, so every forward
sees the same prefix. Random token ids (the cost does not depend on them).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from hstap.evaluate.spec import keep_cache
from hstap.models import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 61])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_target("smollm2", device=args.device).model
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    vocab = model.config.vocab_size
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, vocab, (1, args.prompt), device=args.device), past_key_values=cache,
              use_cache=True)
        prefix = torch.arange(args.prompt, device=args.device)
        rows = []
        for n in args.tokens:
            ids = torch.randint(0, vocab, (1, n), device=args.device)
            times = []
            for rep in range(args.reps + 1):
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, past_key_values=cache, use_cache=True)
                sync()
                if rep:
                    times.append(time.perf_counter() - t0)
                keep_cache(cache, prefix)
            rows.append((n, 1000 * statistics.median(times)))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"date {datetime.date.today()}, device {dev}, torch {torch.__version__}, dtype {model.dtype}")
    print(f"command: python {' '.join(sys.argv)}")
    print("| tokens in the forward | ms | × one token |\n|---:|---:|---:|")
    for n, ms in rows:
        print(f"| {n} | {ms:.1f} | {ms / rows[0][1]:.2f} |")


if __name__ == "__main__":
    main()
