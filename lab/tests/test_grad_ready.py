"""bench/grad_ready.py: the order in which the drafter's gradients become final in one backward (what DDP's
overlapped all-reduce could hide). The order is the model's, not the clock's: the head's gradient first, the
decoder layer's once the whole unroll is back, fc's last."""

from __future__ import annotations

import torch

import grad_ready
import train_throughput as tt
from hstap.train import shared


def test_the_heads_gradient_is_final_first_and_the_layers_only_after_the_unroll():
    shape = tt.SHAPES["smollm2"]
    torch.manual_seed(0)
    cfg = grad_ready.DrafterConfig(**shape, draft_vocab_size=512, aux_layer_ids=[1, 14, 26], target_model_id="t",
                                   target_fingerprint="t", target_hidden_size=shape["hidden_size"])
    drafter = grad_ready.Eagle3Drafter(cfg)
    d2t, t2d = grad_ready.build_draft_vocab(torch.randint(0, 1000, (shape["vocab_size"],)), 512)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    model = grad_ready.TTTModel(drafter, grad_ready.target_to_draft_ids(drafter.d2t, shape["vocab_size"]), 3, 0.8,
                                "auto")
    batch = tt.synthetic_batch(shape["hidden_size"], shape["vocab_size"], t2d, 1, 32)
    params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    assert shared.ENABLED  # the trainer's default: weight gradients summed inside the matmuls
    ready = grad_ready.ready_fractions(model, params, batch, torch.device("cpu"))
    assert ready.keys() == params.keys() and all(0 <= f <= 1 for f in ready.values())
    order = sorted(ready, key=ready.get)
    layer = [n for n in order if n.startswith("midlayer.") and n.endswith("proj.weight")]
    assert order[0] == "lm_head.weight" and order[-1] == "fc.weight" and len(layer) == 7
