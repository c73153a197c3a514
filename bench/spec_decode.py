"""τ and wall-clock speedup of speculative decoding on MT-bench, vanilla decoding measured in the same run.

    python bench/spec_decode.py --drafter runs/demo/drafter [--limit 80] [--device cpu|cuda] [--max-new-tokens 256]

Shapes: chain of 3 draft steps (4 tokens per verification at most) and an EAGLE-2 dynamic tree of depth 8 with
60 draft tokens (top-8 per node), greedy. Warm-up runs excluded; τ = generated tokens / verification forwards
(hstap.metrics.acceptance_length); speedup = tokens/s of the method / tokens/s of vanilla on the same prompts.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

from hstap.evaluate.run import EvalConfig, run_eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", default=["chain:3", "tree:8,8,60"])
    args = ap.parse_args()
    cfg = EvalConfig(drafter=args.drafter, bench="mt-bench", limit=args.limit, shapes=args.shapes,
                     max_new_tokens=args.max_new_tokens, device=args.device)
    result = run_eval(cfg, progress=True)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"\ndate {datetime.date.today()}, device {dev}, torch {torch.__version__}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{len(result.prompts)} MT-bench questions (first turn), greedy, max {args.max_new_tokens} new tokens")
    print(f"| shape | τ | tok/s | vanilla tok/s | speedup | identical to vanilla |")
    print(f"|---|---:|---:|---:|---:|---:|")
    for m in result.methods:
        print(f"| {m.shape.label} | {m.tau:.2f} | {m.tokens_per_second:.1f} | "
              f"{result.vanilla.tokens_per_second:.1f} | {result.speedup(m):.2f}× | "
              f"{result.greedy_matches(m)}/{len(result.prompts)} |")


if __name__ == "__main__":
    main()
