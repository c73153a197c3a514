"""Cost of the tap during prefill, side by side in one run: plain prefill vs prefill with hstap's Tap, per teacher.

    python bench/capture_overhead.py --device cuda --shape 8b      # Llama-3.1-8B-shaped, random bf16 weights
    python bench/capture_overhead.py --device cpu --shape smollm2  # the real embedded target
    torchrun --standalone --nproc_per_node 2 bench/capture_overhead.py --device cuda --model /tmp/llama8b
                                        # tensor parallel (transformers' tp_plan), the tap on rank 0 only

Each tapped variant captures 3 layers + one teacher through the same hooks `hstap capture` uses: by default both
teachers, `hidden` and `topk:32` (`--teacher` picks, repeatable). The sink counts samples in memory, so storage
speed is not part of the figure (the store's writer thread is measured separately). Variants alternate (plain,
hidden, topk, plain, ...) and each tapped median is compared with the plain one: overhead = 1 − tapped / plain.
For top-k teachers it then times the teacher's reduction alone on (batch·seq, V) logits of the model's dtype:
`topk_logprobs` (what the tap runs) against the full-vocabulary `log_softmax → topk` it replaced and against a
bare `topk` over the whole row (what its block candidates avoid), and prints the largest difference of values.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

import harness
from hstap.capture.hf import hf_taps
from hstap.capture.tap import Batch, Tap
from hstap.capture.teacher import topk_logprobs
from hstap.config import TeacherSpec


def build_model(shape: str, device: str, model_dir: str | None = None):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if model_dir is not None:  # a checkpoint (bench/make_checkpoint.py); split over the ranks under torchrun
        parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1
        kwargs = {"tp_plan": "auto"} if parallel else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kwargs)
        return (model if parallel else model.to(device)).eval()
    if shape == "smollm2":
        from hstap.models import load_target

        return load_target("smollm2", device=device).model
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def teacher_reduction_ms(logits: torch.Tensor, k: int, reps: int) -> dict[str, float]:
    """Median ms of the top-k teacher's reduction of `logits` (T, V): the cheap one and the one it replaced."""
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    ways = {"topk_logprobs": lambda: topk_logprobs(logits, k),
            "log_softmax+topk": lambda: torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1),
            "row topk alone": lambda: logits.topk(k, dim=-1)}  # what the block candidates avoid
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(reps + 1):
        for name, way in ways.items():
            sync()
            t0 = time.perf_counter()
            way()
            sync()
            if r:
                times[name].append(1000 * (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = harness.parser(__doc__, repeat=8, warmup=2)
    ap.add_argument("--shape", default="8b", choices=["8b", "smollm2"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--teacher", action="append", default=None,
                    help="hidden or topk:K; repeat for several (default: hidden and topk:32)")
    ap.add_argument("--model", default=None, help="a checkpoint dir instead of --shape (tensor parallel under torchrun)")
    args = ap.parse_args()
    run = harness.start(args)

    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.device.startswith("cuda"):
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(args.device)
    model = build_model(args.shape, args.device, args.model)
    n_layers = model.config.num_hidden_layers
    layers = [1, n_layers // 2 - 1, n_layers - 4]
    teachers = [TeacherSpec.parse(t) for t in (args.teacher or ["hidden", "topk:32"])]
    b, s = args.batch, args.seq
    batch = Batch(ids=[str(i) for i in range(b)], rows=list(range(b)), starts=[0] * b, lengths=[s] * b)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    kept = [0]

    gen = torch.Generator(device=args.device).manual_seed(0)  # every rank feeds the same ids

    def prefill(tap: Tap | None) -> float:
        ids = torch.randint(0, model.config.vocab_size, (b, s), device=args.device, generator=gen)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if tap is not None:
                tap.begin(batch)
            model(input_ids=ids, use_cache=False)
            if tap is not None:
                tap.end()
        sync()  # the forward's own time: the tap's copies finish on a side stream and a writer thread
        return time.perf_counter() - t0

    taps = {str(t): Tap({f"hidden.{k}" for k in layers} | {"teacher"}, teacher=t, hidden_size=model.config.hidden_size,
                        sink=lambda sid, tensors: kept.__setitem__(0, kept[0] + 1)) for t in teachers}
    times: dict[str, list[float]] = {"plain": [], **{name: [] for name in taps}}
    for r in range(args.repeat + args.warmup):
        dt = prefill(None)
        if r >= args.warmup:  # warm-up excluded
            times["plain"].append(dt)
        for teacher, (name, tap) in zip(teachers, taps.items()):
            # under tensor parallelism only rank 0 taps, as `hstap capture` does
            hooks = hf_taps(model, tap, layers, teacher.kind) if rank == 0 else contextlib.nullcontext()
            with hooks:
                dt = prefill(tap if rank == 0 else None)
            if r >= args.warmup:
                times[name].append(dt)
            tap.wait_capacity()
    reports = [tap.close() for tap in taps.values()]
    if rank != 0:
        return
    for report in reports:
        assert report.errors == 0, report.summary()
    assert kept[0] == (args.repeat + args.warmup) * b * len(taps), f"{kept[0]} samples handed off"
    rate = {k: b * s / statistics.median(v) for k, v in times.items()}
    numbers = print_rates(args, rate, layers, list(taps))
    numbers["teacher_reduction"] = {str(t): compare_reductions(model, b * s, t.k, args.device, args.repeat)
                                    for t in teachers if t.kind == "topk"}
    run.finish(numbers)


def print_rates(args, rate: dict[str, float], layers: list[int], teachers: list[str]) -> dict:
    """Print tokens/s of plain and tapped prefill and each teacher's overhead; return them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"{world} process(es), {'model ' + args.model if args.model else 'shape ' + args.shape}, "
          f"batch {args.batch}x{args.seq}, layers {layers}, teachers {', '.join(teachers)}, median of {args.repeat}")
    for k, v in rate.items():
        print(f"{k:>8}: {v:10.0f} tok/s")
    overhead = {name: 1 - rate[name] / rate["plain"] for name in teachers}
    for name in teachers:
        print(f"tap overhead, teacher {name}: {100 * overhead[name]:.1f}%")
    return {"world_size": world, "layers": layers, "tokens_per_s": rate, "tap_overhead": overhead}


def compare_reductions(model, rows: int, k: int, device: str, reps: int) -> dict:
    """The top-k teacher's reduction alone, old and new, on logits shaped as one prefill's: ms per way and the
    largest difference of values."""
    gen = torch.Generator(device=device).manual_seed(1)
    vocab = model.config.vocab_size
    logits = (4 * torch.randn(rows, vocab, device=device, generator=gen)).to(model.dtype)  # (T, V)
    ms = teacher_reduction_ms(logits, k, reps)
    values, _ = topk_logprobs(logits, k)
    ref = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1).values
    print(f"top-{k} teacher reduction of {rows} x {vocab} {str(model.dtype).removeprefix('torch.')} logits: "
          + ", ".join(f"{name} {v:.2f} ms" for name, v in ms.items())
          + f"; largest |difference| {float((values - ref).abs().max()):.2e}")
    return {"ms": ms, "largest_difference": float((values - ref).abs().max())}


if __name__ == "__main__":
    main()
