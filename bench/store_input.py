"""The trainer's wait for its next batch from a store, with and without reading it ahead, side by side in one run.

    python bench/store_input.py --shape 8b --seq 2048 --batch 1 --step-ms 75 [--device cuda] [--steps 12]

Writes a store of random states of the shape (3 bf16 layers of H, a top-32 teacher; `--teacher hidden` the final
state instead, made top-k on `--device`), then times `--steps` training steps the way `hstap train` takes them:
`load_batch` for the step's batch, then the device step, which the host waits for at the step's read-back. The
device step is stood in for by a sleep of `--step-ms` (the host is idle while the GPU trains, as in that wait:
an 8B drafter's graphed step at 2,048 positions is ~75 ms on an H200), so the figures are the host's side of
the input pipeline, on whatever machine runs it. Arms, alternated step by step:
- `now`: the batch read and collated when the step asks for it (before 2026-12-05);
- `ahead`: `StoreSource.prefetch` reads and collates the next batch on a host thread during the step.
Per arm: the median wait for the batch, and the step time it makes (wait + device step).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import harness
from hstap.store import StoreMeta, StoreWriter, open_store
from hstap.train.data import StoreSource, load_batch

SHAPES = {"8b": (4096, [2, 16, 29], 128256), "smollm2": (576, [1, 15, 28], 49152)}


def write_store(path: Path, shape: str, seq: int, samples: int, teacher: str) -> list[int]:
    """`samples` random samples of `seq` tokens; returns the store's layer ids."""
    hidden, layers, vocab = SHAPES[shape]
    meta = StoreMeta(model_id=f"bench/{shape}", model_fingerprint="bench", layer_ids=layers, hidden_size=hidden,
                     hidden_dtype="bf16", teacher=teacher)
    with StoreWriter(path, meta, shard_bytes=1 << 30) as writer:
        for i in range(samples):
            g = torch.Generator().manual_seed(i)
            sample = {"input_ids": torch.randint(0, vocab, (seq,), generator=g),
                      "loss_mask": torch.ones(seq, dtype=torch.bool)}
            if teacher == "hidden":
                sample["teacher.hidden"] = torch.randn(seq, hidden, generator=g).bfloat16()
            else:
                sample["teacher.topk_ids"] = torch.randint(0, vocab, (seq, 32), generator=g, dtype=torch.int32)
                sample["teacher.topk_logprobs"] = torch.randn(seq, 32, generator=g)
            for k in layers:
                sample[f"hidden.{k}"] = torch.randn(seq, hidden, generator=g).bfloat16()
            writer.add(f"s{i}", sample)
    return layers


def main() -> None:
    ap = harness.parser(__doc__, device="cpu", warmup=2)
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="samples a batch")
    ap.add_argument("--step-ms", type=float, default=75.0, help="the device step the host waits for")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per arm")
    ap.add_argument("--teacher", default="topk:32", choices=["topk:32", "hidden"])
    ap.add_argument("--dir", type=Path, default=None, help="where the store goes (default: a temporary dir)")
    args = ap.parse_args()
    run = harness.start(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        batches = 2 * args.steps + 2  # every batch read once: the page cache holds the store as it would a hot one
        layers = write_store(Path(tmp) / "store", args.shape, args.seq, batches * args.batch, args.teacher)
        store = open_store(Path(tmp) / "store")
        head = None
        if args.teacher == "hidden":
            hidden, _, vocab = SHAPES[args.shape]
            head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=torch.bfloat16 if cuda else None)
        source = StoreSource(store, lm_head=head, pin=cuda)
        plan = [list(range(b * args.batch, (b + 1) * args.batch)) for b in range(batches)]
        waits: dict[str, list[float]] = {"now": [], "ahead": []}
        for step, indices in enumerate(plan[:-1]):
            arm = "ahead" if step % 2 else "now"  # `ahead`: the step before read this one's batch ahead
            start = time.perf_counter()
            batch = load_batch(source, indices, layers, device)
            if arm == "now":  # as the trainer does: the next batch is asked for once this one is in hand
                source.prefetch(plan[step + 1])
            if cuda:
                torch.cuda.current_stream(device).synchronize()  # the copy done: the step could start
            waited = time.perf_counter() - start
            time.sleep(args.step_ms / 1000)  # the device step; the host waits for its read-back
            if step >= args.warmup:  # the first of each arm warms the page cache and the allocator
                waits[arm].append(waited)
            del batch
    size = store.manifest.totals.bytes / batches
    print(f"# store input, {args.shape} shape, {args.batch} x {args.seq} tokens a batch ({size / 2**20:.0f} MiB on "
          f"disk), teacher {args.teacher}, device step {args.step_ms:.0f} ms, device {device}")
    base = statistics.median(waits["now"]) * 1000 + args.step_ms
    numbers = {"batch_bytes": size}
    for arm, values in waits.items():
        wait = statistics.median(values) * 1000
        step = wait + args.step_ms
        numbers[arm] = {"wait_ms": wait, "step_ms": step, "steps_per_s_vs_now": base / step, "timed": len(values)}
        print(f"{arm:>6}: wait for the batch {wait:7.1f} ms (median of {len(values)}), step {step:7.1f} ms, "
              f"{base / step:.2f}x the `now` arm's steps a second")
    run.finish(numbers)


if __name__ == "__main__":
    main()
