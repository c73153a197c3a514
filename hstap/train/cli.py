"""`hstap train`: flags → TrainConfig → run_train."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 drafter (offline from a store, or --online)")
    p.add_argument("--store", type=Path, default=None, help="capture store to train from (offline)")
    p.add_argument("--online", action="store_true", help="run the target in-process; no store on disk")
    p.add_argument("--model", default="smollm2", help="the target: 'smollm2' or a checkpoint dir")
    p.add_argument("--data", default="sharegpt", help="(online) sharegpt | mt-bench | jsonl:PATH")
    p.add_argument("--limit", type=int, default=None, help="(online) first N usable conversations")
    p.add_argument("--layers", default="auto", help="(online) canonical layer ids or 'auto'")
    p.add_argument("--max-tokens", type=int, default=1024, help="(online) longest sample, in tokens")
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch (per rank)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="batches per rank per optimizer step (global batch = ranks × this × --batch-tokens)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll length")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (default min(32000, V))")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of samples held out for evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--time-budget", dest="time_budget_s", type=_duration, default=None,
                   help="fit the run (schedule included) into this wall time: 90s, 8m, 1h")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint exactly")
    p.add_argument("--plan", action="store_true", help="print the resolved config and exit")


def _duration(text: str) -> float:
    """'90', '90s', '8m', '1.5h' → seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 8m or 1h, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from hstap.cli import stage_config
    from hstap.train.run import TrainConfig, run_train

    cfg = stage_config(TrainConfig, args)
    if args.plan:
        return 0
    print(run_train(cfg).summary())
    return 0
