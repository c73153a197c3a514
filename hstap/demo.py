"""`hstap demo`: the main job on the embedded default (SmolLM2 + ShareGPT), on a CPU.

For now: capture a few ShareGPT conversations and print the store summary. Training, evaluation and export join
as their stages land.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded default")
    p.add_argument("--limit", type=int, default=16, help="ShareGPT conversations to capture")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory")


def run(args: argparse.Namespace) -> int:
    from hstap.capture.run import CaptureConfig, run_capture
    from hstap.store import store_info
    from hstap.store.cli import format_info

    cfg = CaptureConfig(model="smollm2", data="sharegpt", limit=args.limit, out=args.out / "capture", max_tokens=512)
    result = run_capture(cfg)
    print(result.summary())
    print(format_info(store_info(cfg.out)))
    return 1 if result.tap_report.errors else 0
