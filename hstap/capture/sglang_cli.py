"""`hstap sglang-flags --model M --layers auto --out DIR`: print the SGLang launch flags a capture needs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("sglang-flags", help="print SGLang's --forward-hooks JSON and the other flags capture needs")
    p.add_argument("--model", required=True, help="'smollm2' or a checkpoint directory (reads its config.json; "
                                                  "the weights need not be there)")
    p.add_argument("--layers", default="auto", help="'auto' = [1, L//2-1, L-4] or canonical ids like 1,14,26")
    p.add_argument("--out", type=Path, required=True, help="capture directory (the store the engine writes)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="hidden-state storage dtype")
    p.add_argument("--shard-mb", type=float, default=64, help="shard size in MiB")
    p.add_argument("--flush-s", type=float, default=1.0, help="commit buffered samples after this long idle")
    p.add_argument("--json", action="store_true", help="print only the --forward-hooks JSON")


def run(args: argparse.Namespace) -> int:
    from hstap.capture.arch import fallback_note
    from hstap.capture.engine import EngineCaptureConfig
    from hstap.capture.sglang import format_flags, hook_specs, sglang_flags

    cfg = EngineCaptureConfig.for_checkpoint(args.model, args.layers, args.out, "sglang", args.dtype, args.shard_mb,
                                             args.flush_s)
    note = fallback_note(cfg.layout, "sglang")
    if note:
        print(note, file=sys.stderr)
    print(json.dumps(hook_specs(cfg)) if args.json else format_flags(sglang_flags(cfg)))
    return 0
