"""`hstap eval`: flags → EvalConfig → run_eval.

    hstap eval --drafter runs/drafter --bench mt-bench --limit 20 --chain 3
    hstap eval --drafter runs/drafter --bench jsonl:prompts.jsonl --tree 8,8,60 --chain 3 --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="speculative decoding with the embedded target: τ, acceptance, speedup")
    p.add_argument("--model", default="smollm2", help="the target: 'smollm2' or a checkpoint dir")
    p.add_argument("--drafter", type=Path, required=True, help="drafter run directory (written by `hstap train`)")
    p.add_argument("--bench", default="mt-bench", help="mt-bench | sharegpt | jsonl:PATH (first user turn each)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--chain", type=int, action="append", default=[], metavar="K",
                   help="chain draft of K tokens (repeatable; default 3 when no shape is given)")
    p.add_argument("--tree", action="append", default=[], metavar="D,TOPK,N",
                   help="EAGLE-2 dynamic tree: depth, top-k per node, draft tokens (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = speculative sampling")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each method on the first prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None, help="report directory (default: the drafter's)")
    p.add_argument("--json", action="store_true", help="print report.json to stdout instead of a summary")
    p.add_argument("--plan", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    from hstap.cli import stage_config
    from hstap.evaluate.run import EvalConfig, run_eval

    shapes = [f"chain:{k}" for k in args.chain] + [f"tree:{t}" for t in args.tree]
    cfg = stage_config(EvalConfig, args, **({"shapes": shapes} if shapes else {}))
    if args.plan:
        return 0
    result = run_eval(cfg, progress=not args.json)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0
