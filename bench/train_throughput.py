"""Drafter training throughput (tokens/s), model FLOPs utilisation and peak memory for TTT training steps on
synthetic inputs of a real shape, on one device or on several GPUs under torchrun (DDP, as `hstap train` runs it).

    python bench/train_throughput.py --device cpu --shape smollm2 --draft-vocab 8192 --ttt-steps 7
    python bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 --seq 2048 8192
    torchrun --standalone --nproc_per_node 2 bench/train_throughput.py --device cuda --shape 8b --seq 2048

Synthetic aux states and teacher top-k (random), the real training path (`TTTModel` + AdamW as `hstap train` builds
it, wrapped in DDP when WORLD_SIZE > 1), warm-up excluded (on CUDA the first steps also compile flex attention).
Every rank trains a batch of its own, so tokens/s is the sum over ranks; peak memory is per GPU. MFU = model FLOPs
(`hstap.train.flops`: fc, layer, lm_head and the real TTT attention — causal prefix plus diagonal — per step,
forward + backward) / step time / `--peak-tflops` (default: the H200's dense bf16 peak, 989.4 TFLOP/s), and also
as a fraction of the matrix-multiply rate measured here first (an 8192³ bf16 product on CUDA). `--seq` takes
several lengths, measured one after another in one process. `--fused both` times every length with the
drafter's elementwise chains eager, then fused (`hstap.drafter.fused`, torch.compile on CUDA), side by side;
`--attention flex flash` times each TTT attention backend in turn, in the same process, and `--wgrad gemm autograd`
each way of summing the steps' weight gradients (hstap.train.shared), `--merge triton compiled` each diagonal
merge of the flex path (hstap.train.merge_kernel), `--head triton compiled` each head-loss block
(hstap.train.head_kernel). `--graph both` times each
length without, then with the forward and backward replayed from a CUDA graph (`hstap train --cuda-graphs`,
hstap.train.graphed; capture and warm-ups untimed); under torchrun a graphed step's gradients are averaged by one
all-reduce after it (hstap.train.gradsync), `--grad-reduce overlap after` times the plain step both ways, and
`--grad-reduce-dtype fp32 bf16` each arm with the gradients crossing in fp32, then bf16.
Rank 0 prints; `--json` adds machine-readable lines.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time

import torch

import harness
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, fused, target_to_draft_ids
from hstap.errors import first_line
from hstap.metrics import tokens_per_second
from hstap.train import distributed
from hstap.train import attention, merge_kernel, shared
from hstap.train.loss import HEAD_KERNEL
from hstap.train.flops import ttt_train_flops
from hstap.train.gradsync import FlatGradients
from hstap.train.graphed import GraphedTTT
from hstap.train.ttt import TTTBatch, TTTModel, autocast, batch_tensors

H200_BF16_DENSE_TFLOPS = 989.4  # NVIDIA's H200 SXM figure without sparsity; the device README measured ~790 in matmuls

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, target_num_layers=30),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=128256, target_num_layers=32),
}


def synthetic_batch(h: int, vocab: int, t2d: torch.Tensor, b: int, s: int) -> TTTBatch:
    in_vocab = torch.nonzero(t2d).flatten()
    topk_ids = in_vocab[torch.randint(0, len(in_vocab), (b, s, 32))]
    return TTTBatch(aux=torch.randn(b, s, 3 * h, dtype=torch.bfloat16), input_ids=torch.randint(0, vocab, (b, s)),
                    loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                    topk_ids=topk_ids, topk_logprobs=torch.log_softmax(torch.randn(b, s, 32), -1))


_BF16_DDP: dict[int, torch.nn.Module] = {}  # the DDP wrapper with the bf16 hook, per TTTModel (made at first use)


def matmul_tflops(device: torch.device) -> float:
    """The device's measured matrix-multiply rate: an 8192³ bf16 product on CUDA (1024³ fp32 elsewhere), mean of
    10 after 3 warm-ups."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def train_step(model, opt, batch: TTTBatch, device: torch.device, flat: FlatGradients | None = None) -> None:
    """One optimizer step as `hstap train` takes it: TTT forward under autocast, backward (DDP's all-reduce inside
    it, or `flat`'s after it), AdamW."""
    with autocast(device):
        loss = model(*batch_tensors(batch))[0]
    opt.zero_grad(set_to_none=flat is None)
    loss.backward()
    if flat is not None:
        flat.average()
    opt.step()


def graphed_step(graph: GraphedTTT, opt, batch: TTTBatch, device: torch.device,
                 flat: FlatGradients | None = None) -> None:
    """`train_step` as `hstap train --cuda-graphs` takes it: the forward and backward replayed from the batch
    shape's CUDA graph (captured at the first call, with its warm-ups), the ranks' gradients averaged by one
    all-reduce after it (`flat`, under torchrun: `--grad-reduce after`), AdamW eager, gradients zeroed in place."""
    graph(batch, autocast(device))
    if flat is not None:
        flat.average()
    opt.step()
    opt.zero_grad(set_to_none=False)


def time_steps(step, steps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of `step()` over `steps` calls, `warmup` calls before them excluded."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + warmup):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_profile(model, opt, batch: TTTBatch, device: torch.device, rows: int) -> None:
    """One training step under torch.profiler: the `rows` ops with the most device (CUDA) or CPU self time, then
    the same ops split by their input shapes (which tensor a copy_ or add_ moves says where it comes from: on
    2026-12-03 copies and in-place adds were a quarter of the 8B step, unattributed)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        train_step(model, opt, batch, device)
        if cuda:
            torch.cuda.synchronize()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    print("by input shape:")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows, max_name_column_width=40,
                                                             max_shapes_column_width=90))


def measure(args, cfg: DrafterConfig, model, opt, dist, t2d: torch.Tensor, seq: int, measured: float,
            on: bool, graphed: bool, after: bool = False, bf16_wire: bool = False) -> dict:
    """Time `args.steps` steps at one length and print (rank 0) tokens/s, MFU and peak memory; `graphed`: the
    forward and backward replayed from a CUDA graph (`graphed_step`; the capture and its warm-ups untimed: they
    run in the first of the `args.warmup` untimed steps). Returns the row's numbers."""
    shape = SHAPES[args.shape]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    cuda = dist.device.type == "cuda"
    torch.manual_seed(1 + dist.rank)  # each rank its own data
    batch = synthetic_batch(h, vocab, t2d, args.batch, seq).to(dist.device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dist.device)
    ttt = getattr(model, "module", model)  # under DDP, the wrapped TTTModel
    opt.zero_grad(set_to_none=True)  # no gradient left by the arm before (a plain step leaves its last one)
    # several ranks: DDP's all-reduce inside the backward, or one after it (what a replayed graph needs)
    wire = torch.bfloat16 if bf16_wire else None
    flat = FlatGradients(opt.param_groups[0]["params"], dist, wire) if dist.enabled and (graphed or after) else None
    if dist.enabled and flat is None and bf16_wire:  # DDP with PyTorch's bf16 hook: a wrapper of its own, made once
        model = _BF16_DDP.setdefault(id(ttt), dist.wrap(ttt, bf16_gradients=True))
    if graphed:  # the trainer's form (hstap train --cuda-graphs): forward + backward replayed, AdamW eager
        graph = GraphedTTT(ttt)
        step = functools.partial(graphed_step, graph, opt, batch, dist.device, flat)
    else:
        step = functools.partial(train_step, ttt if flat is not None else model, opt, batch, dist.device, flat)
    step_s = dist.agree_max(time_steps(step, args.steps, args.warmup, dist.device))  # the slowest rank
    kernels = "fused" if on and fused.active() and cuda else "eager"  # after the steps: a failed compile says eager
    kernels += " graphed" if graphed else ""
    reduce = ("after" if flat is not None else "overlap") if dist.enabled else "none"
    kernels += f", gradients all-reduced {reduce} in {'bf16' if bf16_wire else 'fp32'}" if dist.enabled else ""
    tokens = args.batch * seq * dist.world_size
    tflops = ttt_train_flops(cfg, seq, args.ttt_steps, args.batch) / step_s / 1e12  # per GPU
    mfu, of_matmul = tflops / args.peak_tflops, tflops / measured
    peak_gib = torch.cuda.max_memory_allocated(dist.device) / 2**30 if cuda else float("nan")
    peak_gib = dist.agree_max(peak_gib) if cuda else peak_gib
    backend = getattr(model, "module", model).attention  # under DDP, the wrapped TTTModel's
    if dist.rank == 0:
        print(f"seq {seq} [{backend}, {kernels}]: train step {1000 * step_s:.0f} ms, "
              f"{tokens_per_second(tokens, step_s):.0f} tok/s over {dist.world_size} rank(s), {tflops:.3g} TFLOP/s "
              f"of model FLOPs per device: MFU {100 * mfu:.1f}% ({100 * of_matmul:.1f}% of the measured matmul "
              f"rate), peak memory {peak_gib:.1f} GiB per GPU")
    row = {"ranks": dist.world_size, "step_ms": 1000 * step_s, "peak_gib": peak_gib,
           "tokens_per_s": tokens_per_second(tokens, step_s), "shape": args.shape, "seq": seq, "batch": args.batch,
           "ttt": args.ttt_steps, "tflops_per_gpu": tflops, "mfu": mfu, "matmul_tflops": measured,
           "attention": backend, "kernels": kernels, "grad_reduce": reduce,
           "grad_reduce_dtype": "bf16" if bf16_wire else "fp32", "flex_mode": attention.FLEX_COMPILE_MODE or "default",
           "wgrad": "gemm" if shared.ENABLED else "autograd",
           "merge": "triton" if merge_kernel.KERNELS.enabled else "compiled",
           "merge_kernel_failure": merge_kernel.KERNELS.failure,
           "head": "triton" if HEAD_KERNEL.enabled else "compiled", "head_kernel_failure": HEAD_KERNEL.failure}
    if dist.rank == 0 and args.json:
        print(json.dumps(row))
    if args.profile and dist.rank == 0 and not graphed:
        print_profile(model, opt, batch, dist.device, args.profile)
    del batch, step
    if graphed or flat is not None:
        opt.zero_grad(set_to_none=True)  # the next arm starts from no gradients (none of them flat views)
    if graphed:
        del graph
        torch.cuda.empty_cache()
    return row


def build_parser() -> argparse.ArgumentParser:
    """The script's flags: the harness's, the shape, and one list of arms per training choice."""
    ap = harness.parser(__doc__, warmup=2)
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs="+", default=[512], help="one or more sequence lengths")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=attention.BACKENDS,
                    help="TTT attention backend(s), each timed at every length, in order, in one process (auto: flex "
                         "on CUDA; math: materialised prefix scores)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="the MFU denominator")
    ap.add_argument("--fused", default="on", choices=["on", "off", "both"],
                    help="the drafter's fused elementwise chains (CUDA); both = eager then fused, per length")
    ap.add_argument("--flex-mode", nargs="+", default=["default"], metavar="MODE",
                    help="torch.compile mode(s) of the flex attention kernel, each length timed in every one, in "
                         "order (e.g. default max-autotune-no-cudagraphs)")
    ap.add_argument("--graph", default="off", choices=["off", "on", "both"],
                    help="CUDA: the forward and backward replayed from a CUDA graph, as hstap train --cuda-graphs "
                         "runs them; both = plain then graphed, per length (under torchrun the graphed steps' "
                         "gradients are all-reduced after the backward: --grad-reduce after)")
    ap.add_argument("--grad-reduce", nargs="+", default=["overlap"], choices=["overlap", "after"],
                    help="under torchrun, how the plain (not graphed) steps average gradients, each timed in turn: "
                         "overlap (DDP, all-reduced during the backward) or after (one flat all-reduce once it is "
                         "done, as hstap train --grad-reduce after)")
    ap.add_argument("--wgrad", nargs="+", default=["gemm"], choices=["gemm", "autograd"],
                    help="where the TTT steps' weight gradients are summed, each timed in turn in one process: gemm "
                         "(inside the weight-gradient matmuls, hstap.train.shared, as hstap train runs) or autograd "
                         "(a bf16 add per step)")
    ap.add_argument("--merge", nargs="+", default=["triton"], choices=["triton", "compiled"],
                    help="the flex path's diagonal merge on CUDA, each timed in turn in one process: triton "
                         "(hstap.train.merge_kernel, as hstap train runs) or compiled (torch.compile's)")
    ap.add_argument("--head", nargs="+", default=["triton"], choices=["triton", "compiled"],
                    help="the head loss's block on CUDA, each timed in turn in one process: triton "
                         "(hstap.train.head_kernel, as hstap train runs) or compiled (torch.compile's)")
    ap.add_argument("--grad-reduce-dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                    help="under torchrun, the dtype gradients cross the link in, each timed in turn (bf16: hstap "
                         "train --grad-reduce-dtype bf16; DDP's arms through PyTorch's bf16 hook, NCCL only)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per length with the numbers")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing each length, profile one more step and print its N costliest kernels")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    run = harness.start(args)
    dist = distributed.setup(args.device)
    graph_modes = {"off": [False], "on": [True], "both": [False, True]}[args.graph]
    if True in graph_modes and dist.device.type != "cuda":
        ap.error("--graph: CUDA graphs need --device cuda")
    torch.manual_seed(0)  # the same weights on every rank, as DDP expects
    shape = SHAPES[args.shape]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    cfg = DrafterConfig(**shape, draft_vocab_size=args.draft_vocab, aux_layer_ids=[1, 14, 26], target_model_id="bench",
                        target_fingerprint="bench", target_hidden_size=h)
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (vocab,)), args.draft_vocab)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    drafter.to(dist.device)
    cuda = dist.device.type == "cuda"
    ttt = TTTModel(drafter, target_to_draft_ids(drafter.d2t, vocab), args.ttt_steps, 0.8, args.attention[0])
    model = dist.wrap(ttt)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                            fused=cuda)  # as hstap.train.run builds it
    measured = matmul_tflops(dist.device)
    if dist.rank == 0:
        print(f"{dist.world_size} rank(s), shape {args.shape}, draft vocab {args.draft_vocab}, TTT {args.ttt_steps}, "
              f"batch {args.batch} per rank, attention {' '.join(args.attention)}, median of {args.steps} steps")
        print(f"measured matmul rate {measured:.3g} TFLOP/s ({'bf16 8192³' if cuda else 'fp32 1024³'}); "
              f"MFU against {args.peak_tflops:.1f} TFLOP/s" + ("" if cuda else " (a GPU figure: n/a here)"))
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.fused]
    rows = []
    for backend, flex_mode, wgrad, merge, head in itertools.product(args.attention, args.flex_mode, args.wgrad,
                                                                   args.merge, args.head):
        ttt.attention = backend
        attention.FLEX_COMPILE_MODE = None if flex_mode == "default" else flex_mode
        shared.ENABLED = wgrad == "gemm"
        merge_kernel.KERNELS.enabled = merge == "triton"
        HEAD_KERNEL.enabled = head == "triton"
        if max(map(len, (args.flex_mode, args.attention, args.wgrad, args.merge, args.head))) > 1 and dist.rank == 0:
            print(f"TTT attention {backend}, flex attention compiled in mode {flex_mode}, weight gradients summed "
                  f"by {wgrad}, diagonal merge {merge}, head loss block {head}")
        for seq in args.seq:
            arms = [(on, graphed, after, bf16) for on, graphed in itertools.product(modes, graph_modes)
                    for after in ([True] if graphed else [r == "after" for r in args.grad_reduce])
                    for bf16 in ([d == "bf16" for d in args.grad_reduce_dtype] if dist.enabled else [False])]
            for on, graphed, after, bf16 in arms:
                fused.enable(on)
                try:
                    rows.append(measure(args, cfg, model, opt, dist, t2d, seq, measured, on, graphed, after, bf16))
                except Exception as e:  # noqa: BLE001 — one configuration that fails (a kernel a GPU refuses) must
                    # not cost the others their measurement: said in one line, and the next one runs
                    if dist.enabled:
                        raise  # the other ranks would wait on a collective this rank skipped
                    opt.zero_grad(set_to_none=True)
                    print(f"seq {seq} [{backend}, graphed {graphed}]: failed: {first_line(e)}")
                    rows.append({"seq": seq, "attention": backend, "graphed": graphed, "wgrad": wgrad,
                                 "merge": merge, "head": head, "error": first_line(e)})
                    if args.json:
                        print(json.dumps(rows[-1]))
    run.finish({"matmul_tflops": measured, "peak_tflops": args.peak_tflops, "rows": rows})
    if dist.enabled:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
