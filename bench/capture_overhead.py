"""Cost of the tap during prefill, side by side in one run: plain prefill vs prefill with hstap's Tap.

    python bench/capture_overhead.py --device cuda --shape 8b      # Llama-3.1-8B-shaped, random bf16 weights
    python bench/capture_overhead.py --device cpu --shape smollm2  # the real embedded target
    torchrun --standalone --nproc_per_node 2 bench/capture_overhead.py --device cuda --model /tmp/llama8b
                                        # tensor parallel (transformers' tp_plan), the tap on rank 0 only

The tapped run captures 3 layers + a top-32 teacher (or `--teacher hidden`) through the same hooks `hstap capture`
uses; the sink counts samples in memory, so storage speed is not part of the figure (the store's writer thread
is measured separately). Variants alternate (plain, tap, plain, tap, ...) and the medians are compared.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import time

import torch

from hstap.capture.hf import hf_taps
from hstap.capture.tap import Batch, Tap
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="8b", choices=["8b", "smollm2"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--teacher", default="topk:32")
    ap.add_argument("--model", default=None, help="a checkpoint dir instead of --shape (tensor parallel under torchrun)")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.device.startswith("cuda"):
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(args.device)
    model = build_model(args.shape, args.device, args.model)
    n_layers = model.config.num_hidden_layers
    layers = [1, n_layers // 2 - 1, n_layers - 4]
    teacher = TeacherSpec.parse(args.teacher)
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

    tap = Tap({f"hidden.{k}" for k in layers} | {"teacher"}, sink=lambda sid, t: kept.__setitem__(0, kept[0] + 1),
              teacher=teacher, hidden_size=model.config.hidden_size)
    times: dict[str, list[float]] = {"plain": [], "tap": []}
    taps = hf_taps(model, tap, layers, teacher.kind) if rank == 0 else contextlib.nullcontext()
    with taps:  # under tensor parallelism only rank 0 taps, as `hstap capture` does
        for r in range(args.reps + 2):
            for variant in ("plain", "tap"):
                dt = prefill(tap if variant == "tap" and rank == 0 else None)
                if r >= 2:  # warm-up excluded
                    times[variant].append(dt)
                tap.wait_capacity()
    report = tap.close()
    if rank != 0:
        return
    assert report.errors == 0 and kept[0] == (args.reps + 2) * b, report.summary()
    rate = {k: b * s / statistics.median(v) for k, v in times.items()}
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"date {datetime.date.today()}, device {world} x {dev}, torch {torch.__version__}, "
          f"{'model ' + args.model if args.model else 'shape ' + args.shape}, "
          f"batch {b}x{s}, layers {layers}, teacher {args.teacher}, median of {args.reps}")
    for k, v in rate.items():
        print(f"{k:>6}: {v:10.0f} tok/s")
    print(f"tap overhead: {100 * (1 - rate['tap'] / rate['plain']):.1f}%")


if __name__ == "__main__":
    main()
