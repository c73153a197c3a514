"""The host's own cost of one drafter training step: the TTT unroll, backward, clipping and AdamW on tensors so
small that the arithmetic is nothing, so what is timed is Python and the operator dispatch that every step pays
whatever its batch, and that a GPU cannot hide when the host is slower than the device.

    python bench/host_overhead.py [--ttt-steps 7] [--attention math] [--steps 10]

On 2026-12-02 the online trainer ran 360 ms a step on an H200 for ~205 ms of device work (docs/benchmarks.md):
this is the per-step cost that fuller batches amortise and fewer, fused operators would cut.
"""

from __future__ import annotations

import time

import torch

import harness
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
from hstap.train.attention import BACKENDS
from hstap.train.ttt import TTTBatch, TTTModel, batch_tensors

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, target_num_layers=30)


def main() -> None:
    ap = harness.parser(__doc__, device=None, warmup=3)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--attention", default="math", choices=BACKENDS)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = harness.start(args)
    torch.manual_seed(0)
    cfg = DrafterConfig(**TINY, draft_vocab_size=256, aux_layer_ids=[1, 14, 26], target_model_id="bench",
                        target_fingerprint="bench", target_hidden_size=TINY["hidden_size"])
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.randint(0, 100, (TINY["vocab_size"],)), 256)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    model = TTTModel(drafter, target_to_draft_ids(drafter.d2t, TINY["vocab_size"]), args.ttt_steps, 0.8,
                     args.attention)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    b, s, h = 2, 16, TINY["hidden_size"]
    in_vocab = torch.nonzero(t2d).flatten()
    batch = TTTBatch(aux=torch.randn(b, s, 3 * h), input_ids=torch.randint(0, TINY["vocab_size"], (b, s)),
                     loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                     topk_ids=in_vocab[torch.randint(0, len(in_vocab), (b, s, 32))],
                     topk_logprobs=torch.log_softmax(torch.randn(b, s, 32), -1))

    def step() -> None:
        loss = model(*batch_tensors(batch))[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    # operators entered from Python or autograd (an aten op inside another one is that op's own business)
    calls = sum(1 for e in prof.events() if e.name.startswith("aten::")
                and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    print(f"TTT {args.ttt_steps}, attention {args.attention}: {ms:.1f} ms of host time per training step, "
          f"{calls} operator calls")
    run.finish({"host_ms_per_step": ms, "operator_calls": calls})


if __name__ == "__main__":
    main()
