"""When in the drafter's backward each parameter's gradient is final: what DDP's overlapped all-reduce can hide.

    python bench/grad_ready.py --shape 8b --draft-vocab 32000 --seq 128 --ttt-steps 3

DDP all-reduces a bucket once every gradient in it is final, while the rest of the backward runs. The TTT unroll
uses each weight once per step, and `hstap.train.shared` hands each weight its gradient once, summed over the
steps, after the unroll's whole backward, so most of the gradient bytes become final only at its very end. This
times one backward of the real `TTTModel` on synthetic inputs (bench/train_throughput.py's) and prints, per
parameter in the order they became final, its size and the fraction of the backward elapsed, then the share of
gradient bytes final before 90 % of it: the most an overlapped all-reduce could hide (`--grad-reduce overlap`),
against one after the backward (`--grad-reduce after`, what CUDA graphs need). On a CPU the fractions are the
CPU's; the order is the model's.
"""

from __future__ import annotations

import time

import torch

import harness
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
from hstap.train import shared
from hstap.train.ttt import TTTModel, autocast, batch_tensors

from train_throughput import SHAPES, synthetic_batch


def ready_fractions(model: TTTModel, params: dict[str, torch.nn.Parameter], batch, device: torch.device
                    ) -> dict[str, float]:
    """Each parameter's moment its gradient became final, as a fraction of one backward's wall time."""
    seen: dict[str, float] = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def mark(name: str):
        def hook(_: torch.Tensor) -> None:
            sync()  # the gradient's kernels done, not only queued
            seen.setdefault(name, time.perf_counter())
        return hook

    handles = [p.register_post_accumulate_grad_hook(mark(n)) for n, p in params.items()]
    with autocast(device):
        loss = model(*batch_tensors(batch))[0]
    sync()
    start = time.perf_counter()
    loss.backward()
    sync()
    took = time.perf_counter() - start
    for h in handles:
        h.remove()
    return {n: (t - start) / took for n, t in seen.items()}


def main() -> None:
    ap = harness.parser(__doc__, device="cpu")
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--wgrad", nargs="+", default=["gemm", "autograd"], choices=["gemm", "autograd"])
    args = ap.parse_args()
    run = harness.start(args)
    device = torch.device(args.device)
    numbers = {}
    shape = SHAPES[args.shape]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    for wgrad in args.wgrad:
        shared.ENABLED = wgrad == "gemm"
        torch.manual_seed(0)
        cfg = DrafterConfig(**shape, draft_vocab_size=args.draft_vocab, aux_layer_ids=[1, 14, 26],
                            target_model_id="bench", target_fingerprint="bench", target_hidden_size=h)
        drafter = Eagle3Drafter(cfg)
        d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (vocab,)), args.draft_vocab)
        drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
        drafter.to(device)
        model = TTTModel(drafter, target_to_draft_ids(drafter.d2t, vocab).to(device), args.ttt_steps, 0.8, "auto")
        batch = synthetic_batch(h, vocab, t2d, 1, args.seq).to(device)
        params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
        ready_fractions(model, params, batch, device)  # warm-up: allocations, first-call costs
        drafter.zero_grad(set_to_none=True)
        ready = ready_fractions(model, params, batch, device)
        total = sum(p.numel() for p in params.values())
        print(f"{args.shape}, draft vocab {args.draft_vocab}, seq {args.seq}, TTT {args.ttt_steps}, {args.device}, "
              f"weight gradients summed by {wgrad}:")
        for name in sorted(ready, key=ready.get):
            print(f"  {ready[name]:5.2f}  {params[name].numel() / 1e6:7.1f} M  {name}")
        early = sum(params[n].numel() for n in ready if ready[n] < 0.9) / total
        print(f"  gradient bytes final before 90 % of the backward: {100 * early:.0f} %")
        numbers[wgrad] = {"ready_fraction": dict(sorted(ready.items(), key=lambda kv: kv[1])),
                          "bytes_final_before_90pct": early}
    run.finish(numbers)


if __name__ == "__main__":
    main()
