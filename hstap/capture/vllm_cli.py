"""`hstap vllm-flags --model M --layers auto --out DIR`: vLLM's launch flags and the `install_taps` call for them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("vllm-flags", help="print vLLM's launch flags and the collective_rpc body that starts capture")
    p.add_argument("--model", required=True, help="'smollm2' or a checkpoint directory (reads its config.json)")
    p.add_argument("--layers", default="auto", help="'auto' = [1, L//2-1, L-4] or canonical ids like 1,14,26")
    p.add_argument("--out", type=Path, required=True, help="capture directory (the store the engine writes)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="hidden-state storage dtype")
    p.add_argument("--rpc", action="store_true", help="print only the POST /collective_rpc JSON body")


def rpc_body(config_json: str) -> str:
    """The body of `POST /collective_rpc` (vLLM's dev endpoint passes string args only)."""
    return json.dumps({"method": "install_taps", "args": [config_json]})


def run(args: argparse.Namespace) -> int:
    from hstap.capture.sglang import format_flags
    from hstap.capture.engine import EngineCaptureConfig
    from hstap.capture.vllm import LAUNCH_FLAGS

    cfg = EngineCaptureConfig.for_checkpoint(args.model, args.layers, args.out, "vllm", args.dtype)
    body = rpc_body(cfg.model_dump_json())
    if args.rpc:
        print(body)
        return 0
    print(f"# launch (VLLM_SERVER_DEV_MODE=1 enables POST /collective_rpc):\n{format_flags(LAUNCH_FLAGS)}")
    print(f"# then start the taps in every worker:\ncurl -s -X POST http://127.0.0.1:8000/collective_rpc "
          f"-H 'content-type: application/json' -d {format_flags([body])}")
    return 0
