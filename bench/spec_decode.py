"""τ and wall-clock speedup of speculative decoding on MT-bench: vanilla, n-gram, chain and tree in one run, on
hstap's runtime (static KV cache, CUDA graphs on a GPU), at one or more batch sizes.

    python bench/spec_decode.py --drafter runs/gpu/drafter --device cuda --dtype bf16 --batch 1,8
    python bench/spec_decode.py --drafter runs/gpu-drafter --device cpu --limit 4 --max-new-tokens 32
    python bench/spec_decode.py --table runs/gpu/drafter/bench.jsonl     # the tables again, from the log
    python bench/spec_decode.py --compare A.jsonl B.jsonl               # τ of B − A per method, paired interval

Defaults: 80 questions (first turn), 256 new tokens, greedy, shapes ngram:3 (prompt lookup, 3 tokens), chain:3
(the drafter's argmax, 3 steps), hybrid:4,2 (the drafter's chain of 4, replaced by prompt lookup's 4 tokens where
the last 2 occurred earlier: the fastest shape measured on the H200), tree:4,4,16 (a small EAGLE-2 tree: a
quarter of the big tree's drafting, 1.33x vanilla with a weaker drafter) and tree:8,8,60 (depth 8, top-8, 60
nodes: the highest τ, but its 2.3 ms of drafting made it slower than the hybrid). One untimed warm-up batch per method (it captures the graphs). τ = generated tokens / verification
forwards (hstap.metrics.acceptance_length); speedup = tokens/s of the method / tokens/s of vanilla, same prompts,
same batches, same run; ms per cycle = wall time of a batch (prefill included) per verification cycle (a decode
step for vanilla), with the drafting and verification parts as the device timed them (CUDA events; wall time on a
CPU), "between" the device time from one cycle's end to the next one's start (the device waiting for the host),
and the prefill (prompt forward, first token, the drafter's step-0 entries) per prompt; "same" = answers identical
to vanilla's token for token (greedy; bf16 rounding makes some differ).
Every finished prompt is appended to a JSONL log (default DRAFTER/bench.jsonl) with its batch size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness
from hstap.config import torch_dtype
from hstap.drafter.load import load_drafter
from hstap.evaluate.run import evaluate_shapes, load_prompts
from hstap.metrics import acceptance_length, tau_difference_interval, tau_interval, tokens_per_second
from hstap.models import load_target
from hstap.runtime.kv import KV_WRITES
from hstap.runtime.shapes import DraftShape
from hstap.runtime.target import PREFILL_BUCKET

# the goals, checked under the batch-1 table: (method, what, bound)
GOALS = [("vanilla", "tok/s", 400.0), ("chain:3", "speedup/τ", 0.85), ("tree:8,8,60", "speedup/τ", 0.70)]


def _totals(records: list[dict], method: str) -> dict:
    keys = ("tokens", "seconds", "verify_forwards", "emitted", "cycles", "draft_seconds", "verify_seconds",
            "between_seconds", "prefill_seconds", "same")
    total = dict.fromkeys(keys, 0.0)
    for r in records:
        g = r["methods"][method]
        for k in keys:
            total[k] += g.get(k, 0) if k != "same" else g["same_as_vanilla"]  # older logs lack the cycle split
    return total


def summary(records: list[dict]) -> dict[str, dict]:
    """τ, tok/s and speedup over vanilla of every method in one log of one batch size: what `table` prints, and
    what lab/ship_drafter.py records in a shipped drafter's provenance."""
    base = _totals(records, "vanilla")
    base_rate = tokens_per_second(int(base["tokens"]), base["seconds"])
    out = {}
    for m in records[0]["methods"]:
        t = _totals(records, m)
        rate = tokens_per_second(int(t["tokens"]), t["seconds"])
        tau = acceptance_length(int(t["emitted"]), int(t["verify_forwards"])) if t["verify_forwards"] else float("nan")
        out[m] = {"tau": tau, "tok_s": rate, "speedup": rate / base_rate if base_rate else float("nan")}
    return out


def read_log(path: Path) -> list[dict]:
    """The per-prompt records of a `--log` JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pairs(records: list[dict], method: str) -> list[tuple[int, int]]:
    """Each prompt's (generated tokens, verification forwards) under `method`."""
    return [(r["methods"][method]["emitted"], r["methods"][method]["verify_forwards"]) for r in records]


def compare(first: list[dict], second: list[dict]) -> str:
    """τ of the second log minus the first's, per method both ran, over the prompts both hold at batch 1, with a
    paired bootstrap interval: a difference whose interval holds 0 is not one these prompts can show."""
    mine = {r["id"]: r for r in first if r.get("batch", 1) == 1}
    theirs = [r for r in second if r.get("batch", 1) == 1 and r["id"] in mine]
    if not theirs:
        raise SystemExit("--compare: the two logs share no batch-1 prompt")
    ours = [mine[r["id"]] for r in theirs]
    methods = [m for m in theirs[0]["methods"] if m != "vanilla" and m in ours[0]["methods"]]
    lines = [f"{len(theirs)} prompts in both logs\n",
             "| method | τ first | τ second | second − first | 95 % interval |", "|---|---:|---:|---:|---|"]
    for m in methods:
        a, b = _pairs(ours, m), _pairs(theirs, m)
        tau_a = acceptance_length(sum(e for e, _ in a), sum(f for _, f in a))
        tau_b = acceptance_length(sum(e for e, _ in b), sum(f for _, f in b))
        lo, hi = tau_difference_interval(b, a)
        lines.append(f"| {m} | {tau_a:.3f} | {tau_b:.3f} | {tau_b - tau_a:+.3f} | {lo:+.3f} to {hi:+.3f} |")
    # wall time on the same prompts too: what an A/B of two runtimes (e.g. --kv-write) is about
    lines += ["", "| method | ms per cycle, first | second | second − first |", "|---|---:|---:|---:|"]
    for m in ["vanilla", *methods]:
        ms = [1000 * sum(r["methods"][m]["seconds"] for r in log) / sum(r["methods"][m]["cycles"] for r in log)
              for log in (ours, theirs)]
        lines.append(f"| {m} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[1] - ms[0]:+.3f} |")
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    """Markdown table over the logged prompts of one batch size, then the goals it meets or misses."""
    methods = list(records[0]["methods"])
    figures = summary(records)
    lines = ["| method | τ | tok/s | speedup | speedup/τ | ms per cycle | drafting ms | verification ms | between ms "
             "| prefill ms per prompt | same as vanilla |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = {}
    for m in methods:
        t = _totals(records, m)
        rate, tau, speedup = figures[m]["tok_s"], figures[m]["tau"], figures[m]["speedup"]
        cycle = 1000 * t["seconds"] / t["cycles"] if t["cycles"] else float("nan")
        draft = 1000 * t["draft_seconds"] / t["cycles"] if t["cycles"] else float("nan")
        verify = 1000 * t["verify_seconds"] / t["cycles"] if t["cycles"] else float("nan")
        rows[m] = {"tok/s": rate, "speedup/τ": speedup / tau}
        between = 1000 * t["between_seconds"] / t["cycles"] if t["cycles"] else float("nan")
        prefill = 1000 * t["prefill_seconds"] / len(records)
        parts = ["–"] * 4
        if m != "vanilla":
            parts = [f"{draft:.2f}", f"{verify:.2f}", f"{between:.2f}", f"{prefill:.1f}"]
            if not t["prefill_seconds"]:  # logs written before 2026-12-01 have no between / prefill times
                parts[2:] = ["–", "–"]
        lines.append(f"| {m} | {tau:.2f} | {rate:.1f} | {speedup:.2f}× | {speedup / tau:.2f} | {cycle:.2f} | "
                     + " | ".join(parts) + f" | {int(t['same'])}/{len(records)} |")
    lines.append("\nτ, 95 % bootstrap interval over these prompts: " + ", ".join(
        f"{m} {lo:.2f}–{hi:.2f}" for m in methods[1:] for lo, hi in [tau_interval(_pairs(records, m))]))
    for m in methods[1:]:
        accepted = [a for r in records for a in r["methods"][m]["accepted"]]
        depth = max(accepted, default=0)
        rates = [sum(a >= k for a in accepted) / len(accepted) for k in range(1, depth + 1)]
        lines.append(f"\n{m}: verifications accepting ≥ k drafts, k = 1..{depth}: "
                     + (" / ".join(f"{r:.3f}" for r in rates) if rates else "none accepted"))
    if records[0].get("batch", 1) == 1:
        lines.append("")
        for m, what, bound in GOALS:
            if m in rows:
                value = rows[m][what]
                lines.append(f"goal {m} {what} ≥ {bound:g}: {value:.2f} — {'met' if value >= bound else 'MISSED'}")
    return "\n".join(lines)


def category_table(records: list[dict]) -> str:
    """τ of every method per MT-bench category (from the question file); empty for prompts of another bench."""
    from hstap.data.categories import CATEGORIES
    from hstap.data.mtbench import mtbench_categories

    category = mtbench_categories()
    if not all(r["id"] in category for r in records):
        return ""
    cats = sorted({category[r["id"]] for r in records}, key=CATEGORIES.index)
    methods = list(records[0]["methods"])
    lines = ["| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for m in methods:
        cells = []
        for c in cats:
            mine = [r["methods"][m] for r in records if category[r["id"]] == c]
            emitted, forwards = sum(g["emitted"] for g in mine), sum(g["verify_forwards"] for g in mine)
            cells.append(f"{acceptance_length(emitted, forwards):.2f}" if forwards else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_tables(records: list[dict]) -> None:
    for batch in sorted({r.get("batch", 1) for r in records}):
        chosen = [r for r in records if r.get("batch", 1) == batch]
        print(f"\n### batch {batch}: {len(chosen)} prompts\n\n{table(chosen)}")
        if by_category := category_table(chosen):
            print(f"\nτ per MT-bench category, batch {batch}:\n\n{by_category}")


def _record(log: Path, batch: int):
    def record(prompt, generations) -> None:
        vanilla = generations["vanilla"].tokens
        methods = {name: {"tokens": len(g.tokens), "seconds": g.seconds, "verify_forwards": g.verify_forwards,
                          "emitted": sum(g.emitted), "accepted": g.accepted, "cycles": g.cycles,
                          "draft_seconds": g.draft_seconds, "verify_seconds": g.verify_seconds,
                          "between_seconds": g.between_seconds, "prefill_seconds": g.prefill_seconds,
                          "same_as_vanilla": g.tokens == vanilla}
                   for name, g in generations.items()}
        with open(log, "a") as f:
            f.write(json.dumps({"id": prompt.id, "batch": batch, "prompt_tokens": len(prompt.ids),
                                "methods": methods}) + "\n")
    return record


def build_parser() -> argparse.ArgumentParser:
    """The script's flags: the harness's, what to decode, the runtime's A/B switches, and the log modes."""
    ap = harness.parser(__doc__)
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--table", type=Path, help="print the tables of an existing log and exit")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("FIRST", "SECOND"),
                    help="τ of SECOND's methods minus FIRST's over their common prompts, with a paired bootstrap "
                         "interval, and exit")
    ap.add_argument("--limit", type=int, default=80, help="MT-bench questions")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N of them (finish a run cut short)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on a CPU")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated (e.g. 1,8)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", default=["ngram:3", "chain:3", "hybrid:4,2", "tree:4,4,16", "tree:8,8,60"])
    ap.add_argument("--no-cuda-graphs", action="store_true", help="the same code, eagerly (for comparison)")
    ap.add_argument("--eager-drafting", action="store_true",
                    help="no compiled graph bodies for any shape (as if every shape had @eager)")
    ap.add_argument("--prefill", choices=["lean", "model"], default="lean",
                    help="the runtime's prefill: LeanLlama's forward (default) or transformers' (the path before "
                         "2026-12-03)")
    ap.add_argument("--prefill-bucket", type=int, default=PREFILL_BUCKET,
                    help="with CUDA graphs, the lean prefill is left-padded to a multiple of this and replayed from "
                         "one graph per width (0: eager prefills, the path before 2026-12-03's second run)")
    ap.add_argument("--kv-write", choices=KV_WRITES, default="scatter",
                    help="the target cache's write form (hstap.runtime.kv.KVCache): an end-to-end A/B of "
                         "bench/verify_cost.py's section 6")
    ap.add_argument("--log", type=Path, help="per-prompt JSONL log (default DRAFTER/bench.jsonl)")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.out and (args.compare or args.table):
        ap.error("--out records a measurement: not with --table or --compare, which read logs")
    if args.compare:
        print(compare(*map(read_log, args.compare)))
        return
    if args.table:
        print_tables(read_log(args.table))
        return
    shapes = [DraftShape.parse(s) for s in args.shapes]
    if args.drafter is None and any(s.uses_drafter for s in shapes):
        ap.error("--drafter is required for chain and tree shapes (or --table LOG)")
    run = harness.start(args)
    started = time.perf_counter()
    target = load_target("smollm2", device=args.device, dtype=torch_dtype(args.dtype) if args.dtype else None)
    drafter = load_drafter(args.drafter, target) if args.drafter else None
    prompts = load_prompts("mt-bench", target.tokenizer, args.limit)[args.skip:]
    log = args.log or (args.drafter or Path(".")) / "bench.jsonl"
    log.write_text("")
    for batch in [int(b) for b in args.batch.split(",")]:
        t0 = time.perf_counter()
        evaluate_shapes(target.model, drafter, prompts, shapes, args.max_new_tokens, set(target.stop_ids),
                        on_prompt=_record(log, batch), batch_size=batch, cuda_graphs=not args.no_cuda_graphs,
                        fused=False if args.eager_drafting else None, prefill=args.prefill,
                        prefill_bucket=args.prefill_bucket, kv_write=args.kv_write)
        print(f"batch {batch}: {time.perf_counter() - t0:.0f} s (graph capture and warm-up included)", flush=True)
    print(f"\ntarget dtype {str(target.model.dtype).removeprefix('torch.')}, CUDA graphs {not args.no_cuda_graphs}")
    print(f"{len(prompts)} MT-bench questions (first turn), greedy, max {args.max_new_tokens} new tokens, "
          f"total {time.perf_counter() - started:.0f} s")
    records = read_log(log)
    print_tables(records)
    print(f"\nper-prompt log: {log}")
    batches = sorted({r.get("batch", 1) for r in records})
    run.finish({"prompts": len(prompts), "log": str(log), "by_batch": {
        b: summary([r for r in records if r.get("batch", 1) == b]) for b in batches}})


if __name__ == "__main__":
    main()
