"""τ of chain, prompt-lookup and hybrid drafting on MT-bench, replayed on the target's own greedy answers
(hstap.train.replay): no decoding loop, so a CPU does all 80 questions in minutes. Tables overall and per
MT-bench category. Speed is bench/spec_decode.py's job; this chooses shapes.

    python bench/replay_tau.py --drafter DIR --max-new-tokens 256 --shapes chain:3 ngram:3 hybrid:3,1 hybrid:3,2
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import harness
from hstap.data.categories import CATEGORIES
from hstap.data.mtbench import mtbench_categories
from hstap.train.replay import chain_runs, greedy_answers, replay
from hstap.drafter.load import load_drafter
from hstap.evaluate.run import load_prompts
from hstap.models import load_target
from hstap.runtime.shapes import DraftShape


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--drafter", type=Path, required=True, help="a drafter dir (hstap train run or bf16 copy)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", default=["ngram:3", "chain:3", "hybrid:3,1", "hybrid:3,2", "hybrid:3"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = harness.start(args)
    start = time.perf_counter()
    target = load_target("smollm2")
    drafter = load_drafter(args.drafter, target)
    prompts = load_prompts("mt-bench", target.tokenizer, args.limit)
    answers = greedy_answers(target, prompts, args.max_new_tokens)
    shapes = [DraftShape.parse(s) for s in args.shapes]
    depth = max(s.depth for s in shapes)
    runs = chain_runs(target, drafter, answers, depth) if any(s.uses_drafter for s in shapes) else None
    category = mtbench_categories()
    cats = sorted({category[a.id] for a in answers}, key=CATEGORIES.index)
    print(f"fp32, {len(answers)} MT-bench first turns, greedy, max {args.max_new_tokens} new tokens, "
          f"drafter {args.drafter}, {time.perf_counter() - start:.0f} s")
    print("\n| shape | τ | " + " | ".join(cats) + " |")
    print("|---|---:|" + "---:|" * len(cats))
    numbers = {}
    for shape in shapes:
        tokens, cycles = replay(answers, runs, shape, args.max_new_tokens)
        per, by_category = [], {}
        for c in cats:
            idx = [i for i, a in enumerate(answers) if category[a.id] == c]
            t, n = replay([answers[i] for i in idx], [runs[i] for i in idx] if runs else None, shape,
                          args.max_new_tokens)
            per.append(f"{t / n:.2f}")
            by_category[c] = t / n
        numbers[shape.spec] = {"tau": tokens / cycles, "tau_by_category": by_category}
        print(f"| {shape.spec} | **{tokens / cycles:.2f}** | " + " | ".join(per) + " |")
    run.finish({"prompts": len(answers), "shapes": numbers})


if __name__ == "__main__":
    main()
