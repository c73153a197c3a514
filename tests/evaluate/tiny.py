"""A tiny random Llama target (3-token vocabulary) and drafter, for exact-distribution tests of sampling."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab

VOCAB = 3


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # sharpen the near-uniform default init: 3-token outcomes 0.9-10 % at T=1
    return model


def tiny_drafter(target: LlamaForCausalLM, seed: int = 1) -> Eagle3Drafter:
    """Random drafter over a 2-token draft vocabulary {0, 2}: it can never propose token 1."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target.config, [0, 1, 2], 2, "tiny", "f")
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.tensor([5, 1, 3]), 2)
    drafter.init_from_target(target, d2t, t2d)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(2.0)  # a draft that is accepted about half the time
    return drafter.eval()


@torch.no_grad()
def exact_joint(model: LlamaForCausalLM, prompt: list[int], n: int, temperature: float) -> dict[tuple, float]:
    """P(first n generated tokens) under softmax(logits / T), by enumeration."""
    probs = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, pr in probs.items():
            logits = model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
            p = torch.softmax(logits.float() / temperature, -1)
            for tok in range(VOCAB):
                nxt[seq + (tok,)] = pr * float(p[tok])
        probs = nxt
    return probs
