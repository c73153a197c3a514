"""Where the verification forward's extra time goes: a Q-token block against a one-token step, kernel by kernel.

On the H200 (2026-12-03) a chain:3 verification (Q = 4) took 2.19 ms against ~1.94 ms for a vanilla step, and a
61-token tree only 0.3 ms more than that: the first extra tokens cost far more than later ones. This bench splits
the difference three ways, each replayed from CUDA graphs (batch 1, a prompt already in the cache):

1. the whole target forward (`Runtime.block`) per Q: ms per replay;
2. each of the target's matmul shapes alone per M (= Q): µs per GEMM inside a graph of back-to-back calls, as
   `F.linear(x, W)` (what the forward runs) and as `x @ Wt` with the weight stored transposed, to see whether
   a few-row GEMM falls off the one-row kernel;
3. the kernels of one replay, Q = 1 against the other Qs, grouped by kernel name: the names that grow the most.

    python bench/verify_cost.py --device cuda                   # SmolLM2-135M-shaped, random bf16 weights
    python bench/verify_cost.py --device cuda --model smollm2   # the real target (the package's weights)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hstap.runtime.target import Runtime

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, max_position_embeddings=8192)


def build(model: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    if model == "smollm2":
        from hstap.models import load_target

        return load_target("smollm2", device=device, dtype=dtype).model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(dtype).eval()


def replay_ms(fn, reps: int, cuda: bool) -> float:
    """Median ms of fn over `reps` runs, each of 20 calls back to back (graph replays queue without a host wait)."""
    times = []
    for rep in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if rep >= 2:
            times.append((time.perf_counter() - t0) / 20)
    return 1000 * statistics.median(times)


def graphed(body, cuda: bool):
    """body captured once into a CUDA graph (warmed up on a side stream first); eager on a CPU."""
    if not cuda:
        return body
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def forward_bodies(rt: Runtime, qs: list[int]) -> dict[int, object]:
    """One `Runtime.block` body per Q: a causal block at the current write position (write_at is not advanced, so
    every replay writes the same columns)."""
    slot = rt.slot
    bodies = {}
    for q in qs:
        tokens = torch.randint(0, rt.lean.vocab_size, (1, q), device=rt.device)
        depths = torch.arange(q, device=rt.device)[None]
        tree = torch.ones(q, q, dtype=torch.bool, device=rt.device).tril()
        bodies[q] = (lambda tokens=tokens, depths=depths, tree=tree: rt.block(slot, tokens, depths, tree))
    return bodies


def gemm_table(rt: Runtime, qs: list[int], reps: int, cuda: bool) -> list[tuple[str, int, float, float]]:
    """(name, M, µs per F.linear, µs per x @ Wt) for each of the target's matmul shapes, 30 calls per graph."""
    layer = rt.lean.layers[0]
    shapes = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "lm_head": rt.lean.lm_head}
    rows = []
    for name, weight in shapes.items():
        transposed = weight.t().contiguous()  # (K, N)
        for m in qs:
            x = torch.randn(1, m, weight.shape[1], device=rt.device, dtype=weight.dtype)
            ways = {"linear": lambda x=x, w=weight: [F.linear(x, w) for _ in range(30)],
                    "matmul_t": lambda x=x, w=transposed: [torch.matmul(x, w) for _ in range(30)]}
            us = {k: 1000 * replay_ms(graphed(fn, cuda), reps, cuda) / 30 for k, fn in ways.items()}
            rows.append((name, m, us["linear"], us["matmul_t"]))
    return rows


def kernel_profile(replay, cuda: bool, reps: int = 20) -> dict[str, float]:
    """µs per replay spent in each kernel name (device time), over `reps` replays."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(reps):
            replay()
        if cuda:
            torch.cuda.synchronize()
    per_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        kind = getattr(event, "device_type", None)
        if cuda and kind != torch.autograd.DeviceType.CUDA:
            continue
        per_name[event.name[:90]] += (event.device_time if cuda else event.cpu_time) / reps
    return dict(per_name)


@torch.inference_mode()  # the runtime's cache is made under inference mode (prefill): writes to it must be too
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=["random", "smollm2"], default="random")
    ap.add_argument("--prompt", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 61])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12, help="kernel names shown per Q")
    ap.add_argument("--no-gemm", action="store_true", help="leave out the per-shape GEMM table")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.model, args.device, dtype)
    rt = Runtime(model, batch_size=1, max_len=args.prompt + 256, len_bucket=args.prompt + 512, max_slots=1,
                 prefill_bucket=0)
    ids = torch.randint(0, rt.lean.vocab_size, (1, args.prompt), device=rt.device)
    rt.prefill(ids, torch.ones_like(ids), 128)
    bodies = forward_bodies(rt, args.tokens)  # kept: a graph reads its inputs' memory, which must stay theirs
    replays = {q: graphed(body, cuda) for q, body in bodies.items()}
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"date {datetime.date.today()}, device {dev}, torch {torch.__version__}, {args.model} weights, {dtype}, "
          f"prompt {args.prompt} tokens in the cache, batch 1")
    print(f"command: python {' '.join(sys.argv)}")

    print("\n1. the target forward of a Q-token block, one graph replay\n\n| Q | ms | vs Q=1 |\n|---:|---:|---:|")
    ms = {q: replay_ms(replay, args.reps, cuda) for q, replay in replays.items()}
    for q, t in ms.items():
        print(f"| {q} | {t:.3f} | +{t - ms[args.tokens[0]]:.3f} |")

    print("\n2. one GEMM of each shape, µs inside a graph\n\n| matmul | M | F.linear(x, W) | x @ Wt |\n"
          "|---|---:|---:|---:|")
    for name, m, linear, matmul_t in ([] if args.no_gemm else gemm_table(rt, args.tokens, max(3, args.reps // 4),
                                                                           cuda)):
        print(f"| {name} | {m} | {linear:.2f} | {matmul_t:.2f} |")

    base = kernel_profile(replays[args.tokens[0]], cuda)
    print(f"\n3. kernels of one replay: µs per name, Q={args.tokens[0]} against each Q (largest growth first)")
    for q in args.tokens[1:]:
        prof = kernel_profile(replays[q], cuda)
        grow = sorted(set(base) | set(prof), key=lambda n: base.get(n, 0.0) - prof.get(n, 0.0))
        print(f"\nQ={q}: total {sum(prof.values()):.1f} µs against {sum(base.values()):.1f}\n\n"
              f"| kernel | µs at Q={args.tokens[0]} | µs at Q={q} | growth |\n|---|---:|---:|---:|")
        for name in grow[: args.top]:
            print(f"| `{name}` | {base.get(name, 0.0):.1f} | {prof.get(name, 0.0):.1f} | "
                  f"{prof.get(name, 0.0) - base.get(name, 0.0):+.1f} |")


if __name__ == "__main__":
    main()
