"""How full the trainer's batches are: real tokens per batch, against the token budget and against the padded
tokens, for several sorting-window sizes of `plan_batches`, on the lengths of a synth JSONL (prompt + answer tokens
as synth counted them, capped at --max-tokens).

    python bench/batch_fill.py runs/synth.jsonl --batch-tokens 32768 --buckets 64 256 1024 4096

A window of `bucket` samples is sorted by length and cut into batches; its last batch is a leftover, so small windows
leave many half-empty steps (the GPU recipe of 2026-12-02 trained on 44 % full batches: docs/benchmarks.md).
"""

from __future__ import annotations

import json

import harness
from hstap.train.data import BUCKET, plan_batches


def lengths_of(path: str, max_tokens: int) -> list[int]:
    """Sample lengths of a synth JSONL: prompt + completion tokens (+1 for the closing template token), capped."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(min(max_tokens, r["prompt_tokens"] + r["completion_tokens"] + 1))
    return out


def fill(lengths: list[int], batch_tokens: int, bucket: int) -> dict:
    plan = plan_batches(list(range(len(lengths))), lengths, batch_tokens, seed=0, epoch=0, bucket=bucket)
    real = sum(lengths[i] for b in plan for i in b)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in plan)
    return {"bucket": bucket, "batches": len(plan), "real_per_batch": real / len(plan),
            "padded_per_batch": padded / len(plan), "of_budget": real / (len(plan) * batch_tokens),
            "real_of_padded": real / padded}


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("synth", help="a synth JSONL (prompt_tokens and completion_tokens per line)")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 256, BUCKET, 4096])
    args = ap.parse_args()
    run = harness.start(args)
    lengths = lengths_of(args.synth, args.max_tokens)
    print(f"{len(lengths)} samples, mean {sum(lengths) / len(lengths):.0f} tokens, batches of {args.batch_tokens}")
    print("| window (samples) | batches | real tokens/batch | padded tokens/batch | real/budget | real/padded |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for bucket in args.buckets:
        rows.append(r := fill(lengths, args.batch_tokens, bucket))
        print(f"| {bucket}{' (default)' if bucket == BUCKET else ''} | {r['batches']} | {r['real_per_batch']:,.0f} | "
              f"{r['padded_per_batch']:,.0f} | {r['of_budget']:.0%} | {r['real_of_padded']:.0%} |")
    run.finish({"samples": len(lengths), "mean_tokens": sum(lengths) / len(lengths), "windows": rows})


if __name__ == "__main__":
    main()
