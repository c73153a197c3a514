"""Model FLOPs of a TTT training step, from the drafter's shape: the numerator of MFU.

    flops = ttt_train_flops(cfg, seq=2048, steps=7, batch=1)      # one optimizer step's useful work

Counted per sequence of S tokens, a multiply-add as 2 FLOPs:
- `fc` (n_aux·H_target → H), once: forward plus its weight gradient (its input, the captured states, needs none).
- per TTT step, forward × 3 (forward, input gradient, weight gradient):
  - `layer`: q, k, v, o and the MLP, per token 2·(2H·nh·hd + 2·2H·nkv·hd + nh·hd·H + 3·H·I);
  - `lm_head`: 2·H·Vd per token;
  - `attention`: QKᵀ and PV over the pairs a step-k query really sees — the S(S+1)/2 causal step-0 pairs plus
    its k diagonal keys per position — 4·hd·nh per pair.
Not counted: norms, rotary, softmax, the loss's elementwise work, and what a kernel computes beyond the useful
pairs (the masked half of the diagonal blocks). Nothing is recomputed in the backward (hstap.train.loss).
"""

from __future__ import annotations

from hstap.drafter.config import DrafterConfig


def ttt_forward_flops(cfg: DrafterConfig, seq: int, steps: int, batch: int = 1) -> dict[str, int]:
    """Forward FLOPs of a `steps`-step unroll over `batch` sequences of `seq` tokens, by part (see the module)."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    tokens = batch * seq
    layer = 2 * (2 * h * nh * hd + 2 * 2 * h * nkv * hd + nh * hd * h + 3 * h * cfg.intermediate_size)
    pairs = sum(seq * (seq + 1) // 2 + k * seq for k in range(steps))  # per sequence, over all steps
    return {"fc": 2 * len(cfg.aux_layer_ids) * cfg.target_hidden_size * h * tokens,
            "layer": steps * layer * tokens,
            "lm_head": steps * 2 * h * cfg.draft_vocab_size * tokens,
            "attention": 4 * hd * nh * pairs * batch}


def ttt_train_flops(cfg: DrafterConfig, seq: int, steps: int, batch: int = 1) -> int:
    """Forward + backward FLOPs of one training step: fc × 2, everything else × 3."""
    fwd = ttt_forward_flops(cfg, seq, steps, batch)
    return 2 * fwd["fc"] + 3 * (fwd["layer"] + fwd["lm_head"] + fwd["attention"])
