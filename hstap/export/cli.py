"""`hstap export --drafter DIR --format sglang|vllm --out DIR`: flags → export_drafter."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hstap.export.formats import DTYPES, FORMATS

_SERVE_HINTS = {
    "sglang": "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4",
    "vllm": "vllm serve TARGET --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": 3}}'",
}


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a trained drafter as an SGLang or vLLM EAGLE-3 draft checkpoint")
    p.add_argument("--drafter", type=Path, required=True, help="training run directory (config.json + weights)")
    p.add_argument("--format", dest="fmt", required=True, metavar="|".join(FORMATS),
                   help=f"engine to load it: {', '.join(FORMATS)}")
    p.add_argument("--out", type=Path, required=True, help="directory to create")
    p.add_argument("--dtype", default="bfloat16", metavar="|".join(DTYPES), help="floating-point weight dtype")
    p.add_argument("--with-embedding", action="store_true",
                   help="also write embed_tokens.weight (only SGLang with pipeline parallelism reads it)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    from hstap.export import export_drafter

    out = export_drafter(args.drafter, args.fmt, args.out, dtype=args.dtype, include_embedding=args.with_embedding,
                         force=args.force)
    ids = json.loads((out / "hstap.json").read_text())
    print(f"exported {args.drafter} as {args.fmt} ({args.dtype}) to {out}")
    print(f"  layer ids: canonical {ids['aux_layer_ids']} = SGLang {ids['engine_layer_ids']['sglang']} "
          f"= vLLM {ids['engine_layer_ids']['vllm']}")
    print(f"  serve: {_SERVE_HINTS[args.fmt].format(out=out)}")
    return 0
