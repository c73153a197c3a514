"""Decode throughput of the embedded synth backend against plain `model.generate`, same batches, one run.

    .venv/bin/python bench/synth.py [--device cpu|cuda] [--batch 8] [--prompts 16] [--new 32] [--repeat 2]
    python bench/synth.py --device cuda --batch 256 --prompts 1024 --new 256        # the H200 figure

Prompts are real ShareGPT first turns rendered as synth renders them (capped at --max-prompt tokens), split into
batches of --batch. Every row generates exactly --new tokens (stops ignored; `min_new_tokens` for generate), so
each side does the same work. tokens/s = generated tokens / wall seconds, prefill included, median of --repeat
after one untimed warm-up pass (which also captures the CUDA graphs). Compared, in alternation:
`generate` (greedy, DynamicCache), hstap `eager` (our loop, DynamicCache) and hstap `static` (preallocated cache;
with CUDA graphs on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import harness
from hstap.data import open_source, render_prompt
from hstap.metrics import tokens_per_second
from hstap.models import load_target
from hstap.runtime.decode import EagerStepper, Request, decode, left_pad
from hstap.runtime.target import Runtime


def _prompts(tokenizer, n: int, cap: int) -> list[list[int]]:
    out = []
    for conv in open_source("sharegpt"):
        if len(out) == n:
            break
        out.append(render_prompt(conv.messages[:1], tokenizer)[-cap:])  # keep the assistant header at the end
    return out


def build_parser() -> argparse.ArgumentParser:
    """The script's flags: the harness's, the batches, and the optional arms and checks."""
    ap = harness.parser(__doc__, device="cpu", repeat=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="tokens generated per row")
    ap.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept per row")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--compile", action="store_true", help="also time the static path with a torch.compile'd step")
    ap.add_argument("--also-batch", type=int, nargs="*", default=[], metavar="B",
                    help="also time the static path with the same prompts in batches of B (is synth's batch size "
                         "what holds its throughput down?)")
    ap.add_argument("--no-eager", action="store_true", help="leave out hstap's eager loop (a GPU run's slowest arm)")
    ap.add_argument("--check", type=int, default=0, metavar="N",
                    help="then decode the first N prompts with every runtime path and with an fp32 copy of the model: "
                         "how many greedy tokens each bf16 path keeps equal to fp32 (is the compiled step as right "
                         "as the eager kernels?)")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = harness.start(args)

    target = load_target("smollm2", device=args.device)
    model, tok = target.model, target.tokenizer
    pad = tok.pad_token_id
    prompts = _prompts(tok, args.prompts, args.max_prompt)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    tokens = len(prompts) * args.new
    on_cuda = args.device.startswith("cuda")
    static = Runtime(model, batch_size=args.batch, max_len=args.max_prompt + args.new + 256, cuda_graphs=on_cuda)
    eager = EagerStepper(model)

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    def run_generate() -> None:
        for batch in batches:
            ids, mask = left_pad(batch, pad, args.device)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=False, pad_token_id=pad)

    def run_hstap(stepper, size: int = args.batch) -> None:
        for i in range(0, len(prompts), size):
            decode(stepper, [Request(p, args.new) for p in prompts[i:i + size]], pad, [], args.device,
                   sync_every=8 if on_cuda else 1)

    methods = {"generate": run_generate, "hstap eager": lambda: run_hstap(eager),
               "hstap static" + (" + CUDA graphs" if on_cuda else ""): lambda: run_hstap(static)}
    if args.no_eager:
        del methods["hstap eager"]
    for size in args.also_batch:
        runtime = Runtime(model, batch_size=size, max_len=args.max_prompt + args.new + 256, cuda_graphs=on_cuda)
        methods[f"hstap static, batch {size}"] = lambda runtime=runtime, size=size: run_hstap(runtime, size)
    if args.compile:
        compiled = Runtime(model, batch_size=args.batch, max_len=args.max_prompt + args.new + 256,
                           cuda_graphs=on_cuda, compile_step=True)
        methods["hstap static + compile" + (" + graphs" if on_cuda else "")] = lambda: run_hstap(compiled)
    times: dict[str, list[float]] = {k: [] for k in methods}
    with torch.inference_mode():
        for name, fn in methods.items():  # warm-up: lazy inits, cuBLAS handles, compilation, graph capture
            t0 = time.perf_counter()
            fn()
            print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.repeat):
            for name, fn in methods.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)

    rate = {k: tokens_per_second(tokens, statistics.median(v)) for k, v in times.items()}
    print(f"dtype {next(model.parameters()).dtype}")
    print(f"{len(prompts)} ShareGPT prompts (mean {statistics.mean(map(len, prompts)):.0f} tokens), batch "
          f"{args.batch}, {args.new} new tokens per row, {tokens} tokens per pass, median of {args.repeat}")
    for name, r in rate.items():
        print(f"{name:>36}: {r:9.1f} tok/s  ({r / rate['generate']:.2f}x generate)")
    numbers = {"prompts": len(prompts), "tokens_per_pass": tokens, "tokens_per_s": rate}
    if args.check:
        paths = {"static": static, **({"static + compile": compiled} if args.compile else {})}
        numbers["agreement_with_fp32"] = check_against_fp32(paths, prompts[:args.check], args, pad)
    run.finish(numbers)


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_against_fp32(paths: dict[str, Runtime], prompts: list[list[int]], args, pad: int) -> dict:
    """Greedy tokens of each runtime path against the same runtime on an fp32 copy of the model, per prompt: the
    length of the equal prefix (bf16 paths drift from fp32 at near-tied logits; a wrong kernel drifts at once).
    Returns each path's equal-prefix lengths."""
    reference = load_target("smollm2", device=args.device, dtype=torch.float32).model
    paths = {"fp32 static": Runtime(reference, batch_size=args.batch, max_len=args.max_prompt + args.new + 256,
                                    cuda_graphs=args.device.startswith("cuda")), **paths}
    out: dict[str, list[list[int]]] = {name: [] for name in paths}
    with torch.inference_mode():
        for name, stepper in paths.items():
            for i in range(0, len(prompts), args.batch):
                gens = decode(stepper, [Request(p, args.new) for p in prompts[i:i + args.batch]], pad, [], args.device)
                out[name] += [g.tokens for g in gens]
    ref = out.pop("fp32 static")
    print(f"greedy agreement with fp32 over {len(prompts)} prompts x {args.new} tokens (equal prefix length):")
    for name, seqs in out.items():
        prefix = [_same_prefix(s, r) for s, r in zip(seqs, ref)]
        whole = sum(p == args.new for p in prefix)
        print(f"{name:>36}: mean {statistics.mean(prefix):6.1f}, median {statistics.median(prefix):6.1f}, "
              f"all {args.new} equal in {whole} of {len(prompts)}; first 16 equal in "
              f"{sum(p >= 16 for p in prefix)}")
    found = {name: [_same_prefix(s, r) for s, r in zip(seqs, ref)] for name, seqs in out.items()}
    if len(out) == 2:
        a, b = out.values()
        prefix = [_same_prefix(x, y) for x, y in zip(a, b)]
        found["static vs static + compile"] = prefix
        print(f"{'static vs static + compile':>36}: mean {statistics.mean(prefix):6.1f}, "
              f"all equal in {sum(p == args.new for p in prefix)} of {len(prompts)}")
    return found


if __name__ == "__main__":
    main()
