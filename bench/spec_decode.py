"""τ and wall-clock speedup of speculative decoding on MT-bench, vanilla decoding measured in the same run.

    python bench/spec_decode.py --drafter runs/gpu/drafter [--limit 80] [--device cpu|cuda] [--max-new-tokens 256]
    python bench/spec_decode.py --table runs/gpu/drafter/bench.jsonl     # the table again, from the log

Shapes: chain of 3 draft steps (4 tokens per verification at most) and an EAGLE-2 dynamic tree of depth 8 with
60 draft tokens (top-8 per node), greedy. Warm-up runs excluded; τ = generated tokens / verification forwards
(hstap.metrics.acceptance_length); speedup = tokens/s of the method / tokens/s of vanilla on the same prompts.
Every finished prompt is appended to a JSONL log (default DRAFTER/bench.jsonl), so a run cut short still gives
the table of the questions it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from hstap.evaluate.config import EvalConfig, shape_fields
from hstap.evaluate.run import run_eval
from hstap.metrics import acceptance_length, tokens_per_second


def table(records: list[dict]) -> str:
    """Markdown table over the logged prompts: one row per draft shape, against the vanilla row."""
    methods = list(records[0]["methods"])
    total = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0, "emitted": 0, "same": 0} for m in methods}
    for r in records:
        for m, g in r["methods"].items():
            t = total[m]
            t["tokens"] += g["tokens"]
            t["seconds"] += g["seconds"]
            t["forwards"] += g["verify_forwards"]
            t["emitted"] += g["emitted"]
            t["same"] += g["same_as_vanilla"]
    base = tokens_per_second(total["vanilla"]["tokens"], total["vanilla"]["seconds"])
    lines = ["| method | τ | tok/s | speedup | output identical to vanilla | ms per verification (incl. drafting) |",
             "|---|---:|---:|---:|---:|---:|"]
    for m in methods:
        t = total[m]
        rate = tokens_per_second(t["tokens"], t["seconds"])
        tau = acceptance_length(t["emitted"], t["forwards"]) if t["forwards"] else float("nan")
        per_forward = 1000 * t["seconds"] / t["forwards"] if t["forwards"] else float("nan")
        lines.append(f"| {m} | {tau:.2f} | {rate:.1f} | {rate / base:.2f}× | {t['same']}/{len(records)} | "
                     f"{per_forward:.1f} |")
    for m in methods[1:]:
        accepted = [a for r in records for a in r["methods"][m]["accepted"]]
        depth = max(accepted, default=0)
        rates = [sum(a >= k for a in accepted) / len(accepted) for k in range(1, depth + 1)]
        lines.append(f"\n{m}: verifications accepting ≥ k drafts, k = 1..{depth}: "
                     + " / ".join(f"{r:.3f}" for r in rates))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--table", type=Path, help="print the table of an existing log and exit")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", default=["chain:3", "tree:8,8,60"])
    ap.add_argument("--log", type=Path, help="per-prompt JSONL log (default DRAFTER/bench.jsonl)")
    args = ap.parse_args()
    if args.table:
        records = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        print(f"{len(records)} prompts\n{table(records)}")
        return
    if args.drafter is None:
        ap.error("--drafter is required (or --table LOG)")

    log = args.log or args.drafter / "bench.jsonl"
    log.write_text("")

    def record(prompt, generations) -> None:
        vanilla = generations["vanilla"].tokens
        methods = {name: {"tokens": len(g.tokens), "seconds": g.seconds, "verify_forwards": g.verify_forwards,
                          "emitted": sum(g.emitted), "accepted": g.accepted, "same_as_vanilla": g.tokens == vanilla}
                   for name, g in generations.items()}
        with open(log, "a") as f:
            f.write(json.dumps({"id": prompt.id, "prompt_tokens": len(prompt.ids), "methods": methods}) + "\n")

    cfg = EvalConfig(drafter=args.drafter, bench="mt-bench", limit=args.limit, **shape_fields(args.shapes),
                     max_new_tokens=args.max_new_tokens, device=args.device)
    result = run_eval(cfg, progress=True, on_prompt=record)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"\ndate {datetime.date.today()}, device {dev}, torch {torch.__version__}, target dtype "
          f"{result.target['dtype']}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{len(result.prompts)} MT-bench questions (first turn), greedy, max {args.max_new_tokens} new tokens")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    print(table(records))
    print(f"per-prompt log: {log}; report: {result.files[0].parent / 'report.md'}")


if __name__ == "__main__":
    main()
