"""Does a score temperature in the greedy EAGLE-2 tree's ranking change τ? The tree keeps the N candidates with the
best cumulative draft log-probability; with log_softmax(logits / T) instead, T < 1 favours deep confident
branches and T > 1 broad ones. If the drafter's probabilities were miscalibrated, some T ≠ 1 would accept more.

    python lab/tree_temperature.py --temperatures 1.0 0.7 1.5 --limit 16 --max-new-tokens 128

The drafter's greedy draft is otherwise unchanged: `draft_tree` is called with a fixed `scale` of T, the hook
the sampled tree uses for its temperature (hstap.runtime.proposals). Prompts: `limit` MT-bench first turns spread
evenly over the 80 (every 80 // limit-th), so all eight categories are in. fp32 on a CPU: τ only, no timing.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

import hstap.runtime.spec as spec
from hstap.drafter.load import load_drafter
from hstap.evaluate.run import evaluate_shapes, load_prompts
from hstap.models import load_target
from hstap.runtime.shapes import DraftShape


def with_temperature(t: float):
    """`draft_tree` with every greedy call's scale set to t (sampled calls keep theirs)."""
    plain = spec.draft_tree

    def draft(lean, drafts, slot, block, depth, topk, scale=None):
        if scale is None and t != 1.0:
            scale = torch.full((block.tokens.shape[0], 1), t, device=block.tokens.device)
        return plain(lean, drafts, slot, block, depth, topk, scale)
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-recipe")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 1.5])
    ap.add_argument("--shape", default="tree:8,8,60")
    ap.add_argument("--limit", type=int, default=16, help="MT-bench questions, spread over the 80")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = DraftShape.parse(args.shape)
    if shape.kind != "tree":
        ap.error(f"--shape {args.shape}: a tree shape (tree:DEPTH,TOPK,NODES); only trees rank by score")
    target = load_target("smollm2", device="cpu")
    drafter = load_drafter(args.drafter, target)
    prompts = load_prompts("mt-bench", target.tokenizer, 80)[:: max(1, 80 // args.limit)][: args.limit]
    print(f"date {datetime.date.today()}, cpu, {torch.get_num_threads()} threads, torch {torch.__version__}, fp32")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{len(prompts)} MT-bench questions x {args.max_new_tokens} new tokens, greedy, {shape.spec}, drafter "
          f"{args.drafter}\n\n| score temperature | τ | seconds |\n|---:|---:|---:|")
    lookup = DraftShape.parse("ngram:3")
    plain = spec.draft_tree
    try:
        for i, t in enumerate(args.temperatures):
            spec.draft_tree = with_temperature(t)
            t0 = time.perf_counter()
            # the first run also decodes prompt lookup (no drafter, no tree: the same at every T) beside vanilla
            vanilla, results = evaluate_shapes(target.model, drafter, prompts, [lookup, shape] if i == 0 else [shape],
                                               args.max_new_tokens, set(target.stop_ids), progress=False)
            if i == 0:
                same = sum(a.tokens == b.tokens for a, b in zip(vanilla.generations, results[-1].generations))
                baselines = (f"vanilla (one token a forward), {lookup.spec} τ {results[0].tau:.3f}; the tree's "
                             f"answers equal vanilla's on {same}/{len(prompts)} prompts")
            print(f"| {t:g} | {results[-1].tau:.3f} | {time.perf_counter() - t0:.0f} |", flush=True)
    finally:
        spec.draft_tree = plain
    print(f"\nsame prompts, the first run: {baselines}")


if __name__ == "__main__":
    main()
