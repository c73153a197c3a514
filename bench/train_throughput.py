"""Drafter training throughput (tokens/s) for one TTT training step, on synthetic inputs of a real shape.

    python bench/train_throughput.py --device cpu --shape smollm2 --draft-vocab 8192 --ttt-steps 7
    python bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --seq 2048

Synthetic aux states and teacher top-k (random), real drafter code path (ttt_forward + AdamW), warm-up excluded.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
from hstap.train.ttt import TTTBatch, ttt_forward

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, target_num_layers=30),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=128256, target_num_layers=32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    h = shape["hidden_size"]
    cfg = DrafterConfig(**shape, draft_vocab_size=args.draft_vocab, aux_layer_ids=[1, 14, 26], target_model_id="bench",
                        target_fingerprint="bench", target_hidden_size=h)
    dev = torch.device(args.device)
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (shape["vocab_size"],)), args.draft_vocab)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    drafter.to(dev)
    t2d_ids = target_to_draft_ids(drafter.d2t, shape["vocab_size"])
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    b, s = args.batch, args.seq
    in_vocab = torch.nonzero(t2d).flatten()
    topk_ids = in_vocab[torch.randint(0, len(in_vocab), (b, s, 32))]
    batch = TTTBatch(aux=torch.randn(b, s, 3 * h, dtype=torch.bfloat16), input_ids=torch.randint(0, 49152, (b, s)),
                     loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                     topk_ids=topk_ids, topk_logprobs=torch.log_softmax(torch.randn(b, s, 32), -1)).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    times = []
    for i in range(args.steps + 2):
        sync()
        t0 = time.perf_counter()
        with autocast:
            out = ttt_forward(drafter, batch, t2d_ids, args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"{platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} threads"
    print(f"date {datetime.date.today()}, device {name}, torch {torch.__version__}, shape {args.shape}, "
          f"draft vocab {args.draft_vocab}, TTT {args.ttt_steps}, batch {b}x{s}")
    print(f"train step {1000 * statistics.median(times):.0f} ms, {b * s / statistics.median(times):.0f} tok/s")


if __name__ == "__main__":
    main()
