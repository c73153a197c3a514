"""What `hstap train --cuda-graphs` captures on a real data set: the graph shapes its batches map to, the positions
a graph computes beyond the eager batch, and the memory the shapes' static inputs hold.

    python bench/graph_shapes.py [--data sharegpt] [--limit 6000] [--max-tokens 2048] \
        [--batch-tokens 16384 32768] [--epochs 2] [--hidden 4096] [--layers 3] [--topk 32]

Lengths are the embedded target's rendering of `--data`; the batches are the trainer's own (`plan_batches`); the
bytes per position are a batch's on the device for a target of `--hidden` (bf16 aux states of `--layers` layers,
int64 ids, bool masks, a top-`--topk` teacher of int64 ids and fp32 log-probs). Static inputs "per shape" is what
each captured shape kept before 2026-12-05; "shared" is `SharedInputs`: one buffer for twice the batch's tokens.
CPU only, no model weights: the tokenizer and the plan.
"""

from __future__ import annotations

import harness
from hstap.data import SkipReport, render_all
from hstap.models import load_tokenizer
from hstap.train.data import plan_batches
from hstap.train.graphed import graph_shape


def main() -> None:
    ap = harness.parser(__doc__.split("\n\n")[0].replace("\n", " "), device=None)
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--limit", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--topk", type=int, default=32)
    args = ap.parse_args()
    run = harness.start(args)

    report = SkipReport()
    samples = render_all(args.data, load_tokenizer("smollm2"), report, max_tokens=args.max_tokens, limit=args.limit)
    lengths = [len(s.input_ids) for s in samples]
    per_position = args.layers * args.hidden * 2 + 8 + 1 + 1 + args.topk * (8 + 4)
    print(f"# {len(lengths)} samples of {args.data} "
          f"(max {args.max_tokens} tokens; {sum(n <= 64 for n in lengths)} of at most 64, "
          f"{sum(n < 32 for n in lengths)} under 32); {per_position:,} B a position on the device")
    print("| batch tokens | batches | shapes | eager positions | graph positions | graph/eager | run eagerly | "
          "largest shape | static inputs per shape | shared |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch_tokens in args.batch_tokens:
        shapes, eager_positions, graph_positions, eager_batches, batches = set(), 0, 0, 0, 0
        for epoch in range(args.epochs):
            for batch in plan_batches(list(range(len(lengths))), lengths, batch_tokens, seed=0, epoch=epoch):
                longest = max(lengths[i] for i in batch)
                batches += 1
                eager_positions += len(batch) * longest
                shape = graph_shape(len(batch), longest, batch_tokens)
                if shape is None:
                    eager_batches += 1
                    graph_positions += len(batch) * longest
                    continue
                shapes.add(shape)
                graph_positions += shape[0] * shape[1]
        largest = max(r * p for r, p in shapes)
        kept = sum(r * p for r, p in shapes) * per_position
        shared = max(2 * batch_tokens, largest) * per_position
        rows.append({"batch_tokens": batch_tokens, "batches": batches, "shapes": len(shapes),
                     "eager_positions": eager_positions, "graph_positions": graph_positions,
                     "run_eagerly": eager_batches, "largest_shape": largest, "static_bytes_per_shape": kept,
                     "static_bytes_shared": shared})
        print(f"| {batch_tokens:,} | {batches:,} | {len(shapes)} | {eager_positions:,} | {graph_positions:,} | "
              f"{graph_positions / eager_positions:.3f} | {eager_batches} | {largest:,} | {kept / 2**30:.2f} GiB | "
              f"{shared / 2**30:.2f} GiB |")
    run.finish({"samples": len(lengths), "bytes_per_position": per_position, "by_batch_tokens": rows})


if __name__ == "__main__":
    main()
