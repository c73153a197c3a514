"""What one cycle of each draft shape costs against one vanilla decoding step, on the runtime (static cache,
lean forward, CUDA graphs on a GPU), batch 1, with a real prompt length in the cache: the break-even τ.

    python bench/forward_cost.py [--device cpu|cuda] [--prompt 300] [--tokens 1 2 4 8 16 32 61]
                                 [--shapes ngram:3 chain:3 tree:8,8,60] [--reorder on from4 off] [--threads 2 1]
                                 [--rounds 3]

A target forward of Q tokens is what verifying a draft of Q-1 nodes costs; drafting is timed on its own (an
untrained drafter of the target's shape: the cost does not depend on the weights). Break-even τ = (drafting +
verification of the shape's block) / one decode step: a method speeds decoding up only when its τ is above it.
Median of `--repeat` after `--warmup` rounds, every forward and drafting taking turns in each rep; random token ids; the
cache state is left as it was after every timed call.
On a CPU the arms run side by side: `--reorder` on (oneDNN's copies where `hstap.runtime.linear.choose_products`
measures them faster: the runtime's default), from4 (the copies from four rows on only, the rule before
2026-12-06, when one-token steps stayed on MKL) or off (no copies); `--threads` the intra-op thread counts.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import harness
from hstap.drafter import DrafterConfig, Eagle3Drafter
from hstap.models import load_target
from hstap.runtime.linear import BEFORE_MEASURING
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from hstap.runtime.target import Runtime


def timed(fns: dict, reps: int, warmup: int, sync) -> dict:
    """Median milliseconds of each of `fns` over `reps` rounds after `warmup` rounds, the calls taking turns
    within each round: load that comes and goes on a shared machine falls on every one alike, so their ratios
    (break-even τ, a one-token against a four-token forward) hold where the milliseconds drift."""
    times: dict = {key: [] for key in fns}
    for rep in range(reps + warmup):
        for key, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if rep >= warmup:
                times[key].append(time.perf_counter() - t0)
    return {key: 1000 * statistics.median(t) for key, t in times.items()}


def measure(model, drafter, shapes: list[DraftShape], args, sync, rule: str,
            ) -> tuple[dict[int, float], dict[str, float], str]:
    """One arm: ms per target forward of each token count, ms of each shape's drafting, and what the projections
    ran, on a fresh runtime (`HSTAP_CPU_REORDER` and the thread count as the caller set them; `rule` "from4": the
    copies used from four rows on only, as before the products were measured)."""
    rt = Runtime(model, batch_size=1, max_len=args.prompt + 512, len_bucket=args.prompt + 1024, max_slots=1)
    products = rt.lean.products
    if rule == "from4":
        for p in rt.lean.projections:
            p.paths = BEFORE_MEASURING
    what = "no oneDNN copies" if products is None else \
        f"oneDNN copies ({rt.lean.reordered_bytes / 2**20:.0f} MiB), " + \
        ("used from 4 rows on" if rule == "from4" else f"measured: {products.describe()}")
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=model.device)
    calls = {}  # ("forward", n) → a target forward of n tokens, ("draft", spec) → a shape's drafting
    with torch.inference_mode():
        rt.prefill(prompt, torch.ones_like(prompt), 256)
        slot = rt.slot
        for n in sorted(set(args.tokens) | {1} | {s.nodes + 1 for s in shapes}):
            ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)
            depths = torch.arange(n, device=model.device)
            tree = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()  # a chain of n
            calls["forward", n] = rt.graph(("forward", n), lambda ids=ids, depths=depths, tree=tree:
                                           rt.block(slot, ids, depths, tree), [])
        for shape in shapes:
            dec = SpecDecoder(rt, shape, drafter if shape.uses_drafter else None)
            if rule == "from4" and dec.lean is not None:  # the drafter's head on the old rule too
                dec.lean.lm_head.paths = BEFORE_MEASURING
            st = dec._state(slot)
            dec._start(st, slot, prompt, prompt[:, -1], torch.zeros(1, args.prompt, 3 * model.config.hidden_size,
                                                                     dtype=model.dtype, device=model.device))
            if st.pend_count is not None:
                st.pend_count.fill_(shape.depth + 1)  # drafting after a fully accepted draft
            calls["draft", shape.spec] = rt.graph(("draft", dec.tag), lambda dec=dec, st=st: dec._draft(st, slot),
                                                  dec._saved(st, slot))
        ms = timed(calls, args.repeat, args.warmup, sync)
    forward_ms = {n: t for (kind, n), t in ms.items() if kind == "forward"}
    drafting_ms = {spec: t for (kind, spec), t in ms.items() if kind == "draft"}
    return forward_ms, drafting_ms, what


def main() -> None:
    ap = harness.parser(__doc__, repeat=10, warmup=2)
    ap.add_argument("--prompt", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 61])
    ap.add_argument("--shapes", nargs="+", default=["ngram:3", "chain:3", "tree:8,8,60"])
    ap.add_argument("--reorder", nargs="+", choices=["on", "from4", "off"], default=["on"],
                    help="arms side by side: the CPU projections with oneDNN's reordered weights where measured "
                         "faster (the default, hstap.runtime.linear), from four rows on only (the rule before "
                         "2026-12-06), or without copies (HSTAP_CPU_REORDER=0); no effect on a GPU")
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                    help="intra-op thread counts, each an arm (default: PyTorch's, one per core)")
    ap.add_argument("--rounds", type=int, default=1, help="the arms alternate this many times; each figure is "
                    "the smallest of its rounds' medians (other load on a shared machine only adds time)")
    args = ap.parse_args()
    run = harness.start(args)
    torch.manual_seed(0)
    model = load_target("smollm2", device=args.device).model
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    shapes = [DraftShape.parse(s) for s in args.shapes]
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, [1, 14, 26], 16384, "x", "x"))
    drafter = drafter.to(device=model.device, dtype=model.dtype).eval()
    arms: dict[tuple[str, int], tuple[dict[int, float], dict[str, float], str]] = {}
    for _ in range(args.rounds):
        for arm in [(rule, n) for rule in args.reorder for n in args.threads]:
            os.environ["HSTAP_CPU_REORDER"] = "0" if arm[0] == "off" else "1"
            torch.set_num_threads(arm[1])
            forward_ms, drafting_ms, what = measure(model, drafter, shapes, args, sync, arm[0])
            if arm in arms:  # the smaller of the rounds' medians
                forward_ms = {n: min(ms, arms[arm][0][n]) for n, ms in forward_ms.items()}
                drafting_ms = {k: min(ms, arms[arm][1][k]) for k, ms in drafting_ms.items()}
            arms[arm] = forward_ms, drafting_ms, what
    print(f"dtype {model.dtype}, CUDA graphs {args.device.startswith('cuda')}")
    numbers = []
    for (rule, threads), (forward_ms, drafting_ms, what) in arms.items():
        numbers.append({"reorder": rule, "threads": threads, "projections": what, "forward_ms": forward_ms,
                        "drafting_ms": drafting_ms, "break_even_tau": {
                            s.spec: (drafting_ms[s.spec] + forward_ms[s.nodes + 1]) / forward_ms[1] for s in shapes}})
        print(f"\n## reorder {rule}, {threads} threads: {what}\n")
        print("| tokens in the forward | ms | × one token |\n|---:|---:|---:|")
        for n in args.tokens:
            print(f"| {n} | {forward_ms[n]:.2f} | {forward_ms[n] / forward_ms[1]:.2f} |")
        print("\n| method | drafting ms | verification ms | cycle ms | break-even τ |\n|---|---:|---:|---:|---:|")
        for shape in shapes:
            draft, verify = drafting_ms[shape.spec], forward_ms[shape.nodes + 1]
            print(f"| {shape.spec} | {draft:.2f} | {verify:.2f} | {draft + verify:.2f} | "
                  f"{(draft + verify) / forward_ms[1]:.2f} |")
        cheapest = min(forward_ms, key=forward_ms.get)
        print(f"\nthe cheapest forward: {cheapest} token{'s' if cheapest > 1 else ''}, "
              f"{forward_ms[cheapest] / forward_ms[1]:.2f} × one token")
    run.finish(numbers)


if __name__ == "__main__":
    main()
