"""How much of a data set's answers are repetition loops: what `--loops cut` would take out of the loss.

    hstap synth --model smollm2 --data sharegpt --limit 64 --max-new-tokens 384 --out runs/greedy.jsonl
    python bench/loop_stats.py --data jsonl:runs/greedy.jsonl [--max-tokens 2048]

Renders every conversation twice, as `hstap capture` and `hstap train --online` do, with `loops="keep"` and with
`loops="cut"` (hstap/data/loops.py), and prints the answers cut, the answer tokens left in the loss and the sample
tokens (what training computes on) of both, and for a synth output also its finish reasons.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import harness
from hstap.data import SkipReport, render_all
from hstap.models import load_tokenizer


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--data", required=True, help="sharegpt | mt-bench | jsonl:PATH")
    ap.add_argument("--model", default="smollm2", help="the tokenizer: 'smollm2' or a checkpoint dir")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    run = harness.start(args)
    tokenizer = load_tokenizer(args.model)
    reports, samples = {}, {}
    for loops in ("keep", "cut"):
        reports[loops] = SkipReport()
        samples[loops] = render_all(args.data, tokenizer, reports[loops], max_tokens=args.max_tokens,
                                    limit=args.limit, loops=loops)
    in_loss = {k: sum(sum(s.loss_mask) for s in v) for k, v in samples.items()}
    tokens = {k: sum(len(s.input_ids) for s in v) for k, v in samples.items()}
    cut = reports["cut"].counts
    looped = cut.get("loop_cut", 0)
    print(f"{args.data}: {len(samples['keep'])} conversations; {looped} answer{'s' * (looped != 1)} end in a loop")
    print(f"answer tokens in the loss: {in_loss['keep']} -> {in_loss['cut']} "
          f"({1 - in_loss['cut'] / max(in_loss['keep'], 1):.1%} out)")
    print(f"sample tokens: {tokens['keep']} -> {tokens['cut']} ({1 - tokens['cut'] / max(tokens['keep'], 1):.1%} fewer)")
    print(f"render report with --loops cut: {reports['cut'].summary()}")
    reasons = {}
    if args.data.startswith("jsonl:"):
        with Path(args.data[len("jsonl:"):]).open() as f:
            reasons = collections.Counter(json.loads(line).get("finish_reason") for line in f if line.strip())
        print(f"finish reasons: {dict(reasons)}")
    run.finish({"conversations": len(samples["keep"]), "answers_cut": looped, "loss_tokens": in_loss,
                "sample_tokens": tokens, "finish_reasons": dict(reasons)})


if __name__ == "__main__":
    main()
