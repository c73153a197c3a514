"""`hstap capture`: flags → CaptureConfig → run_capture."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="prefill conversations through the target and store hidden states")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a transformers checkpoint dir")
    p.add_argument("--data", default="sharegpt", help="sharegpt | mt-bench | jsonl:PATH")
    p.add_argument("--limit", type=int, default=None, help="use the first N usable conversations")
    p.add_argument("--out", type=Path, required=True, help="store directory (re-run to resume)")
    p.add_argument("--layers", default="auto", help="'auto' = [1, L//2-1, L-4] or canonical ids like 1,14,26")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="hidden-state storage dtype")
    p.add_argument("--teacher", default="topk:32", help="topk:K (target top-k log-probs) or hidden (final norm)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per prefill forward")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest sample, in tokens")
    p.add_argument("--overlong", default="truncate", choices=["truncate", "skip"], help="what to do past max-tokens")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--shard-mb", type=float, default=256, help="target shard size in MiB")
    p.add_argument("--force", action="store_true", help="capture even when free disk space looks short")
    p.add_argument("--plan", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    import torch

    from hstap.capture.run import CaptureConfig, run_capture
    from hstap.cli import stage_config
    from hstap.store.cli import format_info
    from hstap.store import store_info

    cfg = stage_config(CaptureConfig, args)
    if args.plan:
        return 0
    result = run_capture(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 holds the store
        print(result.summary())
        print(format_info(store_info(cfg.out)))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if result.tap_report.errors else 0
