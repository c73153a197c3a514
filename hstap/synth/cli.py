"""`hstap synth`: flags -> SynthConfig -> run_synth."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("synth", help="regenerate the assistant turns with the target (embedded or served)")
    p.add_argument("--model", default=None,
                   help="embedded: 'smollm2' or a checkpoint dir; with --server: the model id the servers must serve")
    p.add_argument("--server", dest="servers", action="append", default=[], metavar="URL",
                   help="an OpenAI-compatible server (repeat for round-robin over several)")
    p.add_argument("--data", default="sharegpt", help="sharegpt | mt-bench | jsonl:PATH")
    p.add_argument("--out", type=Path, required=True, help="output FILE.jsonl (re-run to resume)")
    p.add_argument("--limit", type=int, default=None, help="use the first N usable conversations")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, per turn")
    p.add_argument("--turns", default="first", choices=["first", "all"], help="answer the first user turn or all")
    p.add_argument("--concurrency", type=int, default=None,
                   help="conversations in flight (default: 8 per server, or two embedded batches)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per conversation and turn)")
    p.add_argument("--drop-truncated", action="store_true", help="drop answers cut at --max-new-tokens")
    p.add_argument("--device", default="cpu", help="embedded: cpu | cuda | cuda:N")
    p.add_argument("--batch-size", type=int, default=16, help="embedded: rows per decode batch")
    p.add_argument("--compile-step", action="store_true",
                   help="embedded on a GPU: torch.compile the decode step (faster; ~1 min of compiling per "
                        "batch size and cache-length bucket)")
    p.add_argument("--timeout", type=float, default=120.0, help="server: seconds per request")
    p.add_argument("--retries", type=int, default=3, help="server: retries on 5xx, timeouts, connection errors")
    p.add_argument("--plan", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    from hstap.cli import stage_config
    from hstap.synth.config import SynthConfig
    from hstap.synth.run import run_synth

    cfg = stage_config(SynthConfig, args)
    if args.plan:
        return 0
    result = run_synth(cfg)
    print(result.summary())
    return 1 if result.failed else 0
