"""The MFU numerator counts what the drafter really multiplies: checked against PyTorch's FLOP counter on a real
unroll (materialised attention, whose full (S, S) products the counter sees in place of the useful pairs, plus
the diagonal keys' two batched matmuls)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
from hstap.train.flops import ttt_forward_flops, ttt_train_flops
from hstap.train.ttt import TTTBatch, ttt_forward


def test_forward_count_matches_the_flop_counter():
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4],
                        target_model_id="tiny", target_fingerprint="f", target_num_layers=8, target_hidden_size=24)
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.arange(50) % 5, 20)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    b, s, steps = 2, 13, 3
    batch = TTTBatch(aux=torch.randn(b, s, 72), input_ids=torch.randint(0, 50, (b, s)),
                     loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                     topk_ids=torch.randint(0, 50, (b, s, 4)), topk_logprobs=torch.randn(b, s, 4))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ttt_forward(drafter, batch, target_to_draft_ids(drafter.d2t, 50), steps=steps, attention="math")
    fwd = ttt_forward_flops(cfg, s, steps, b)
    full_square = steps * 2 * (2 * b * 4 * s * s * 16)  # QKᵀ and PV over every (query, key) pair, per step
    diagonal = sum(k * s for k in range(steps)) * b * 2 * (2 * 4 * 16)  # step k's k diagonal keys: two matmuls
    assert counter.get_total_flops() == fwd["fc"] + fwd["layer"] + fwd["lm_head"] + full_square + diagonal
    # the useful pairs: causal step-0 keys plus k diagonal keys at step k
    visible = sum(int(torch.ones(s, s).tril().sum()) + k * s for k in range(steps))
    assert fwd["attention"] == 4 * 16 * 4 * visible * b
    assert ttt_train_flops(cfg, s, steps, b) == 2 * fwd["fc"] + 3 * (fwd["layer"] + fwd["lm_head"] + fwd["attention"])
