"""Where the verification forward's extra time goes: a Q-token block against a one-token step, kernel by kernel.

On the H200 (2026-12-03) a chain:3 verification (Q = 4) took 2.19 ms against ~1.94 ms for a vanilla step, and a
61-token tree only 0.3 ms more than that: the first extra tokens cost far more than later ones. This bench splits
the difference, each replayed from CUDA graphs (batch 1, a prompt already in the cache):

1. the whole target forward (`Runtime.block`) per Q: ms per replay; 1b. the same with the other MLP form;
2. each of the target's matmul shapes alone per M (= Q): µs per GEMM inside a graph of back-to-back calls, as
   `F.linear(x, W)` (what the forward runs) and as `x @ Wt` with the weight stored transposed, to see whether
   a few-row GEMM falls off the one-row kernel;
3. the kernels of one replay, Q = 1 against the other Qs, grouped by kernel name: the names that grow the most;
4. (any device, `--census` alone on a CPU) the elementwise ops of one forward by operand layout, per Q: an op
   whose operands are of one shape and dense in one dim order runs CUDA's vectorised kernel, a broadcast or
   strided one the generic `elementwise_kernel<128, 4>`. On 2026-12-03 section 3 showed that kernel growing
   182 → 379 µs from Q = 1 to 2, and this census named the 90 ops behind it: per layer, the MLP's silu and
   product, whose gate and up halves are strided from two rows on, and the rotary's k sum (now dense); the H200
   run of the same day confirmed the k sum dense (60 extra ops, not 90), and the MLP's now use the batched form
   on CUDA (section 5), so the census of a CUDA runtime counts none;
5. one layer's MLP per M in three forms: chunk (the CPU's), columns, batched (CUDA's);
6. one layer's K and V cache write per Q in three forms: the runtime's two scatters, index_copy, index_put.

    python bench/verify_cost.py --device cuda                   # SmolLM2-135M-shaped, random bf16 weights
    python bench/verify_cost.py --device cuda --model smollm2   # the real target (the package's weights)
    python bench/verify_cost.py --device cpu --census           # section 4 only, no GPU needed
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F

import harness
from hstap.runtime.census import elementwise_census
from hstap.runtime.kv import KV_WRITES
from hstap.runtime.llama import MLP_FORMS, LeanLlama, gated_mlp
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


def prefilled_runtime(model: torch.nn.Module, prompt: int, mlp_form: str | None = None) -> Runtime:
    """A one-row runtime with `prompt` random tokens already in its cache (the MLP form: the device's, or this)."""
    rt = Runtime(model, batch_size=1, max_len=prompt + 256, len_bucket=prompt + 512, max_slots=1, prefill_bucket=0,
                 mlp_form=mlp_form)
    ids = torch.randint(0, rt.lean.vocab_size, (1, prompt), device=rt.device)
    rt.prefill(ids, torch.ones_like(ids), 128)
    return rt


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


def us_per_call(call, reps: int, cuda: bool, calls: int = 30) -> float:
    """µs per call of `call` from a graph of `calls` back-to-back calls (one call alone is below a replay's
    resolution)."""
    return 1000 * replay_ms(graphed(lambda: [call() for _ in range(calls)], cuda), reps, cuda) / calls


def gemm_table(rt: Runtime, qs: list[int], reps: int, cuda: bool) -> list[tuple[str, int, float, float]]:
    """(name, M, µs per F.linear, µs per x @ Wt) for each of the target's matmul shapes, 30 calls per graph."""
    layer = rt.lean.layers[0]
    shapes = {"qkv": layer.qkv.weight, "o": layer.o.weight, "gate_up": gate_up_rows(rt), "down": layer.down.weight,
              "lm_head": rt.lean.lm_head.weight}
    rows = []
    for name, weight in shapes.items():
        transposed = weight.t().contiguous()  # (K, N)
        for m in qs:
            x = torch.randn(1, m, weight.shape[1], device=rt.device, dtype=weight.dtype)
            rows.append((name, m, us_per_call(lambda x=x, w=weight: F.linear(x, w), reps, cuda),
                         us_per_call(lambda x=x, w=transposed: torch.matmul(x, w), reps, cuda)))
    return rows


def gate_up_rows(rt: Runtime) -> torch.Tensor:
    """Layer 0's gate and up weights as one (2·I, H) matrix, whichever form the runtime keeps them in."""
    mlp = rt.model.model.layers[0].mlp
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()


def mlp_forms(rt: Runtime, qs: list[int], reps: int, cuda: bool) -> list[tuple[int, dict[str, float]]]:
    """(M, µs per MLP of one layer in each form), 30 calls per graph. "chunk" takes gate and up as the two halves
    of each row of one GEMM's output, contiguous only at M = 1 (section 4's silu and mul at Q ≥ 2); "columns"
    multiplies the weight by the rows' transpose, so both halves are contiguous blocks at every M; "batched" runs
    gate and up as one batched GEMM of two. The runtime picks chunk or batched per device from this table
    (hstap.runtime.llama.mlp_form_for): on the H200 (2026-12-03) batched ties chunk at M = 1 and is 1.8-2.2 µs
    faster from M = 2; on a 2-core CPU batched is 4-11 % slower at M ≤ 2 and columns 2.2x slower at M = 2."""
    layers = {form: rt.lean.layers[0] if form == rt.lean.mlp_form else LeanLlama(rt.model, form).layers[0]
              for form in MLP_FORMS}  # the runtime's own two forms (`gated_mlp`), whichever the device runs
    gate_up = gate_up_rows(rt)
    inner = gate_up.shape[0] // 2

    def columns(x):
        both = torch.mm(gate_up, x.t())  # (2I, M)
        return layers["chunk"].down((F.silu(both[:inner]) * both[inner:]).t())

    forms = {"chunk": lambda x: gated_mlp(layers["chunk"], x), "columns": columns,
             "batched": lambda x: gated_mlp(layers["batched"], x)}
    rows = []
    for m in qs:
        x = torch.randn(m, gate_up.shape[1], device=rt.device, dtype=gate_up.dtype)
        ref = forms["chunk"](x).float()
        for name, form in forms.items():  # the same values, up to the dtype's rounding
            torch.testing.assert_close(form(x).float(), ref, atol=0.05, rtol=0.05, msg=f"MLP form {name}")
        rows.append((m, {name: us_per_call(lambda form=form: form(x), reps, cuda) for name, form in forms.items()}))
    return rows


def kv_write_forms(kv, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, object]:
    """One layer's K and V write into `kv` at columns `cols` (B, Q), k and v (B, H_kv, Q, D) in the layouts the
    forward hands over (k heads first, v a strided slice of the qkv rows), as three bodies: "scatter" and
    "index_copy" are the runtime's own `KVCache.write` in its two forms (the scatter kernel grew from 115 to 188
    µs a forward between Q = 1 and 4 on the H200, 2026-12-03); "index_put" (bench-only) indexes (b, h, col)."""
    b, h = kv.data.shape[1:3]
    caches = {}
    for form in KV_WRITES:  # the same memory, written in each form
        view = kv.rows(0, b)
        view.write_form = form
        caches[form] = (view, view.write_index(cols))
    bi, hi, ci = torch.broadcast_tensors(torch.arange(b, device=cols.device)[:, None, None],
                                         torch.arange(h, device=cols.device)[None, :, None], cols[:, None, :])

    def index_put():
        kv.data[0].index_put_((bi, hi, ci), k)
        kv.data[1].index_put_((bi, hi, ci), v)

    forms = {form: (lambda c=c, i=i: c.write(0, i, k, v)) for form, (c, i) in caches.items()}
    return {**forms, "index_put": index_put}


def kv_write_table(rt: Runtime, qs: list[int], reps: int, cuda: bool) -> list[tuple[int, dict[str, float]]]:
    """(Q, µs per layer's K and V write in each form of `kv_write_forms`), 30 calls per graph; every form is
    checked to leave the cache the runtime's write leaves."""
    lean, rows = rt.lean, []
    for q in qs:
        kv = lean.new_cache(1, 512)
        cols = (torch.arange(q, device=rt.device) + 300)[None]  # (1, Q)
        k = torch.randn(lean.kv_heads, 1, q, lean.head_dim, device=rt.device, dtype=lean.dtype).permute(1, 0, 2, 3)
        qkv = torch.randn(1, q, lean.heads + 2 * lean.kv_heads, lean.head_dim, device=rt.device, dtype=lean.dtype)
        v = qkv[:, :, lean.heads + lean.kv_heads:].transpose(1, 2)
        forms = kv_write_forms(kv, cols, k, v)
        written = {}
        for name, form in forms.items():
            kv.data.zero_()
            form()
            written[name] = kv.data[:2].clone()
        for name, data in written.items():
            assert torch.equal(data, written["scatter"]), f"KV write form {name}"
        rows.append((q, {name: us_per_call(form, reps, cuda) for name, form in forms.items()}))
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
    ap = harness.parser(__doc__, repeat=20)
    ap.add_argument("--model", choices=["random", "smollm2"], default="random")
    ap.add_argument("--prompt", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 61])
    ap.add_argument("--top", type=int, default=12, help="kernel names shown per Q")
    ap.add_argument("--no-gemm", action="store_true", help="leave out the per-shape GEMM table")
    ap.add_argument("--census", action="store_true", help="only section 4 (no timing: any device)")
    args = ap.parse_args()
    run = harness.start(args)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.model, args.device, dtype)
    rt = prefilled_runtime(model, args.prompt)
    bodies = forward_bodies(rt, args.tokens)  # kept: a graph reads its inputs' memory, which must stay theirs
    print(f"{args.model} weights, {dtype}, prompt {args.prompt} tokens in the cache, batch 1")
    numbers = {} if args.census else timings(rt, bodies, args, cuda)
    census = {q: elementwise_census(body) for q, body in bodies.items()}
    numbers["elementwise_census"] = {q: {f"{op} {layout}": n for (op, layout), n in counts.items()}
                                     for q, counts in census.items()}
    keys = sorted(set().union(*census.values()), key=lambda k: (k[1] == "dense", k))
    print("\n4. elementwise ops of one forward by operand layout (broadcast and strided ones run CUDA's generic "
          f"kernel)\n\n| op | layout | {' | '.join(f'Q={q}' for q in args.tokens)} |\n"
          f"|---|---|{'---:|' * len(args.tokens)}")
    for op, layout in keys:
        print(f"| {op} | {layout} | {' | '.join(str(census[q][(op, layout)]) for q in args.tokens)} |")
    if not args.census:
        numbers["mlp_forms_us"] = mlp_forms(rt, args.tokens, max(3, args.repeat // 4), cuda)
        print_forms(f"5. one layer's MLP in three forms, µs inside a graph (the runtime's here: {rt.lean.mlp_form})",
                    "M", numbers["mlp_forms_us"])
        numbers["kv_write_forms_us"] = kv_write_table(rt, args.tokens, max(3, args.repeat // 4), cuda)
        print_forms("6. one layer's K and V write into the cache in three forms, µs inside a graph (the runtime's: "
                    f"{rt.lean.kv_write})", "Q", numbers["kv_write_forms_us"])
    run.finish(numbers)


def print_forms(title: str, size: str, rows: list[tuple[int, dict[str, float]]]) -> None:
    """A section's table: one row per size, µs per form."""
    names = list(rows[0][1])
    print(f"\n{title}\n\n| {size} | {' | '.join(names)} |\n|---:|{'---:|' * len(names)}")
    for n, us in rows:
        print(f"| {n} | {' | '.join(f'{us[name]:.2f}' for name in names)} |")


def timings(rt: Runtime, bodies: dict, args: argparse.Namespace, cuda: bool) -> dict:
    """Sections 1-3: graph-replayed forwards per Q, GEMMs per shape, kernels per name; printed, and returned."""
    replays = {q: graphed(body, cuda) for q, body in bodies.items()}

    print("\n1. the target forward of a Q-token block, one graph replay\n\n| Q | ms | vs Q=1 |\n|---:|---:|---:|")
    ms = {q: replay_ms(replay, args.repeat, cuda) for q, replay in replays.items()}
    for q, t in ms.items():
        print(f"| {q} | {t:.3f} | +{t - ms[args.tokens[0]]:.3f} |")
    other = next(form for form in MLP_FORMS if form != rt.lean.mlp_form)
    other_rt = prefilled_runtime(rt.model, args.prompt, other)  # the same weights: one forward against the other
    other_bodies = forward_bodies(other_rt, args.tokens)
    other_ms = {q: replay_ms(graphed(body, cuda), args.repeat, cuda) for q, body in other_bodies.items()}
    print(f"\n1b. the same forward with the MLP in the {other} form (the runtime's: {rt.lean.mlp_form})\n\n"
          f"| Q | ms, {rt.lean.mlp_form} | ms, {other} | {other} − {rt.lean.mlp_form} |\n|---:|---:|---:|---:|")
    for q, t in ms.items():
        print(f"| {q} | {t:.3f} | {other_ms[q]:.3f} | {other_ms[q] - t:+.3f} |")
    del other_rt, other_bodies

    print("\n2. one GEMM of each shape, µs inside a graph\n\n| matmul | M | F.linear(x, W) | x @ Wt |\n"
          "|---|---:|---:|---:|")
    gemms = [] if args.no_gemm else gemm_table(rt, args.tokens, max(3, args.repeat // 4), cuda)
    for name, m, linear, matmul_t in gemms:
        print(f"| {name} | {m} | {linear:.2f} | {matmul_t:.2f} |")

    base = kernel_profile(replays[args.tokens[0]], cuda)
    kernels = {args.tokens[0]: base}
    print(f"\n3. kernels of one replay: µs per name, Q={args.tokens[0]} against each Q (largest growth first)")
    for q in args.tokens[1:]:
        prof = kernels[q] = kernel_profile(replays[q], cuda)
        grow = sorted(set(base) | set(prof), key=lambda n: base.get(n, 0.0) - prof.get(n, 0.0))
        print(f"\nQ={q}: total {sum(prof.values()):.1f} µs against {sum(base.values()):.1f}\n\n"
              f"| kernel | µs at Q={args.tokens[0]} | µs at Q={q} | growth |\n|---|---:|---:|---:|")
        for name in grow[: args.top]:
            print(f"| `{name}` | {base.get(name, 0.0):.1f} | {prof.get(name, 0.0):.1f} | "
                  f"{prof.get(name, 0.0) - base.get(name, 0.0):+.1f} |")
    return {"forward_ms": ms, f"forward_ms_{other}_mlp": other_ms,
            "gemm_us": [{"matmul": n, "m": m, "linear": a, "x_at_wt": b} for n, m, a, b in gemms],
            "kernel_us_per_replay": kernels}


if __name__ == "__main__":
    main()
