"""Online training throughput on one device — the target's prefill plus the drafter's training step — for the
capture path (what online training ran before: the Tap's pinned-host copies, per-sample dicts, `collate`, the copy
back) against the device path (`DeviceOnlineSource`), without and with prefetch, on the same batches in one run;
on CUDA `--paths device,device+graphs` adds the device path with the drafter's step replayed from CUDA graphs
(`hstap train --cuda-graphs`; every batch shape captured in an untimed pass first).

    python bench/train_online.py --device cuda                  # the SmolLM2 recipe: 16k, 32k, 64k-token batches
    python bench/train_online.py --device cuda --profile runs/prof   # + a torch.profiler trace of the device path
    python bench/train_online.py --device cpu --batch-tokens 1024,2048 --max-tokens 256 --ttt-steps 3 \\
        --draft-vocab 2048 --limit 200 --steps 2 --warmup 1

Real SmolLM2 (bf16 on CUDA, fp32 on a CPU) and real ShareGPT conversations (original answers, rendered with the
chat template, at most --max-tokens each), batched by the trainer's own `plan_batches`; each timed step is the
trainer's own `accumulate` (batch, TTT forward, backward) plus gradient clipping and AdamW, exactly as `hstap train`
runs it. tokens/s counts real (unpadded) tokens, as the trainer reports them. Per path: ms per step, of which the
batch alone (prefill + teacher + hand-off, timed separately on the same batches), tokens/s, peak GPU memory.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import harness
from hstap.data import SkipReport, render_all
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, count_tokens, target_to_draft_ids
from hstap.metrics import tokens_per_second
from hstap.models import load_target
from hstap.train import distributed
from hstap.train.data import OnlineSource, load_batch, plan_batches
from hstap.train.online import DeviceOnlineSource
from hstap.train.graphed import GraphedTTT
from hstap.train.trainer import accumulate
from hstap.train.steplog import StepLog
from hstap.train.ttt import TTTModel, autocast

LAYERS = [1, 14, 26]
PATHS = ("capture", "device", "device+prefetch")  # and, on CUDA, "device+graphs", "device+prefetch+graphs"


def build_drafter(target, source, draft_vocab: int, device: torch.device) -> Eagle3Drafter:
    """The trainer's drafter: draft vocabulary from the samples' answer tokens, the target's embedding, seed 0."""
    vocab = target.model.config.vocab_size
    masks = (dict(zip(("input_ids", "loss_mask"), source.token_masks(i))) for i in range(len(source.ids)))
    d2t, t2d = build_draft_vocab(count_tokens(masks, vocab), min(draft_vocab, vocab))
    cfg = DrafterConfig.from_target(target.model.config, LAYERS, min(draft_vocab, vocab), target.model_id,
                                    target.fingerprint)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target.model, d2t, t2d)
    return drafter.to(device)


def sync_for(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_path(path: str, sources: dict, batches: list[list[int]], warmup: int, drafter: Eagle3Drafter,
              ttt_steps: int, device: torch.device, batch_tokens: int | None = None) -> dict:
    """ms per full training step and per batch alone, over batches[warmup:-1], for one path. The last batch is
    only prefetched (by the last timed step, as in steady state), never trained on."""
    source = sources["capture" if path == "capture" else "device"]
    sync, dist = sync_for(device), distributed.Dist(0, 1, device)
    model = TTTModel(drafter, target_to_draft_ids(drafter.d2t, drafter.config.vocab_size).to(device), ttt_steps, 0.8)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    prefetch = "prefetch" in path
    graphed = GraphedTTT(model, batch_tokens=batch_tokens) if "graphs" in path else None  # padded as the trainer pads
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, timed = 0.0, batches[warmup:-1]
    # with graphs, every length bucket is captured in an untimed first pass: a run replays the graphs of its first
    # steps for the rest of its epochs, and the timed steps measure that steady state (tokens/s counts real tokens,
    # so the padding to the bucket's shape is paid for)
    steplog = StepLog(lambda record: None)
    order = (batches[:-1] if graphed else []) + batches  # the last batch is only ever prefetched
    first_timed = len(order) - 1 - len(timed)
    for i, indices in enumerate(order[:-1]):
        if i == first_timed:
            sync()
            start = time.perf_counter()
        ahead = order[i + 1] if prefetch else None
        loss, step_losses = accumulate(model, source, [indices], LAYERS, device, autocast(device), dist, [ahead],
                                       graphed)
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=graphed is None)
        steplog.hold({}, loss, norm, step_losses)  # read back a step late, as the trainer does
    steplog.flush()
    sync()
    step_s = (time.perf_counter() - start) / len(timed)
    fetch = []
    for indices in timed:  # the batch alone: prefill + teacher + hand-off to the device
        sync()
        t0 = time.perf_counter()
        load_batch(source, indices, LAYERS, device)
        sync()
        fetch.append(time.perf_counter() - t0)
    tokens = statistics.mean(sum(source.lengths[j] for j in b) for b in timed)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"path": path, "step_ms": 1000 * step_s, "batch_ms": 1000 * statistics.median(fetch),
            "tokens_per_s": tokens_per_second(tokens, step_s), "tokens": tokens, "peak_gib": peak}


def profile_device_path(sources: dict, batches: list[list[int]], drafter: Eagle3Drafter, ttt_steps: int,
                        device: torch.device, out: Path) -> None:
    """torch.profiler over a few device-path steps: a Chrome trace and the top ops by device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=True) as prof:
        time_path("device", sources, batches, 1, drafter, ttt_steps, device)
    prof.export_chrome_trace(str(out / "train_online_trace.json"))
    dev = "cuda" if device.type == "cuda" else "cpu"
    ops = prof.key_averages()
    # inclusive time finds the phase (attention, lm_head+loss, prefill); self time the kernels that do the work
    table = (f"by {dev} time, children included\n" + ops.table(sort_by=f"{dev}_time_total", row_limit=30)
             + f"\nby self {dev} time\n" + ops.table(sort_by=f"self_{dev}_time_total", row_limit=30))
    (out / "train_online_ops.txt").write_text(table)
    print(table)


def main() -> None:
    ap = harness.parser(__doc__, warmup=2)
    ap.add_argument("--batch-tokens", default="16384,32768,65536", help="padded tokens per batch, comma-separated")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=2048, help="longest sample")
    ap.add_argument("--limit", type=int, default=3000, help="ShareGPT conversations to batch from")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per path and batch size")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    ap.add_argument("--profile", type=Path, default=None, help="also profile the device path into this directory")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per row")
    args = ap.parse_args()
    device = torch.device(args.device)
    if "graphs" in args.paths and device.type != "cuda":
        ap.error("--paths ...+graphs: CUDA graphs need --device cuda")
    run = harness.start(args)
    target = load_target("smollm2", device=args.device)
    samples = render_all("sharegpt", target.tokenizer, SkipReport(), max_tokens=args.max_tokens, limit=args.limit)
    sources = {"capture": OnlineSource(target, samples, LAYERS, device=args.device),
               "device": DeviceOnlineSource(target, samples, LAYERS, device=args.device)}
    drafter = build_drafter(target, sources["device"], args.draft_vocab, device)
    print(f"SmolLM2 {target.model.dtype}, "
          f"{len(samples)} ShareGPT samples ≤ {args.max_tokens} tokens, layers {LAYERS}, TTT {args.ttt_steps}, "
          f"draft vocab {args.draft_vocab}, {args.steps} timed steps after {args.warmup}", flush=True)
    print("| batch tokens | path | real tokens/batch | batch alone (ms) | step (ms) | tok/s | vs first path | "
          "peak GiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch_tokens in (int(x) for x in args.batch_tokens.split(",")):
        plan = plan_batches(list(range(len(samples))), sources["device"].lengths, batch_tokens, seed=0, epoch=0)
        batches = plan[:args.warmup + args.steps + 1]  # + the one the last timed step prefetches
        if len(batches) < args.warmup + args.steps + 1:
            raise SystemExit(f"only {len(plan)} batches of {batch_tokens} tokens: raise --limit")
        base = None
        for path in args.paths.split(","):
            row = time_path(path, sources, batches, args.warmup, drafter, args.ttt_steps, device, batch_tokens)
            base = base or row["tokens_per_s"]
            rows.append({"batch_tokens": batch_tokens, **row, "vs_first_path": row["tokens_per_s"] / base})
            print(f"| {batch_tokens} | {path} | {row['tokens']:.0f} | {row['batch_ms']:.1f} | {row['step_ms']:.1f} | "
                  f"{row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f}x | {row['peak_gib']:.1f} |",
                  flush=True)
            if args.json:
                print(json.dumps({"batch_tokens": batch_tokens, **row}))
    if args.profile:
        plan = plan_batches(list(range(len(samples))), sources["device"].lengths,
                            int(args.batch_tokens.split(",")[0]), seed=0, epoch=0)
        profile_device_path(sources, plan[:4], drafter, args.ttt_steps, device, args.profile)
    run.finish({"samples": len(samples), "rows": rows})


if __name__ == "__main__":
    main()
