"""The drafter's forward pass against a plain reference, and exact save/load."""

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter
from hstap.train.ttt import TTTAttention


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_theta=10000.0, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4],
                target_model_id="tiny", target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    return DrafterConfig(**{**base, **kw})


def reference_step_outputs(model: Eagle3Drafter, aux, ids, steps):
    """Inference-style chain, one position at a time: step k at t sees step-0 keys ≤ t and its own chain."""
    cfg = model.config
    b, s = ids.shape
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    attn = model.midlayer.self_attn
    h0 = model.project(aux)

    def kv_q(embeds, hidden, pos):
        x = torch.cat([model.midlayer.input_layernorm(embeds), model.midlayer.hidden_norm(hidden)], -1)
        cos, sin = model.rotary(pos, x.dtype)
        from hstap.drafter.model import apply_rope
        q = attn.q_proj(x).view(b, -1, attn.nh, attn.hd).transpose(1, 2)
        k = attn.k_proj(x).view(b, -1, attn.nkv, attn.hd).transpose(1, 2)
        v = attn.v_proj(x).view(b, -1, attn.nkv, attn.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(hidden, out):
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, -1, attn.nh * attn.hd))
        hidden = hidden + model.midlayer.mlp(model.midlayer.post_attention_layernorm(hidden))
        return hidden, model.lm_head(model.norm(hidden))

    pos = torch.arange(s).expand(b, s)
    tok0 = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=ids.dtype)], 1)
    _, k0, v0 = kv_q(model.embed_tokens(tok0), h0, pos)
    per_step = []
    for t in range(s - steps):
        hidden = h0[:, t:t + 1]
        chain_k, chain_v = [], []
        logits_t = []
        for k in range(steps):
            tok = ids[:, t + 1 + k: t + 2 + k]
            q, kk, vv = kv_q(model.embed_tokens(tok), hidden, pos[:, t:t + 1] + k)
            if k > 0:
                chain_k.append(kk), chain_v.append(vv)
            keys = torch.cat([k0[:, :, : t + 1], *chain_k], 2)
            vals = torch.cat([v0[:, :, : t + 1], *chain_v], 2)
            w = torch.softmax((q @ keys.transpose(-1, -2)) * attn.hd ** -0.5, -1)
            hidden, logits = finish(hidden, w @ vals)
            logits_t.append(logits[:, 0])
        per_step.append(torch.stack(logits_t, 1))  # (B, steps, Vd)
    return torch.stack(per_step, 1)  # (B, S-steps, steps, Vd)


def test_ttt_unroll_equals_inference_style_chain():
    torch.manual_seed(0)
    model = Eagle3Drafter(tiny_config()).eval()
    b, s, steps = 2, 9, 3
    aux = torch.randn(b, s, 96)
    ids = torch.randint(0, 50, (b, s))
    ref = reference_step_outputs(model, aux, ids, steps)
    attend = TTTAttention(4, 2)
    hidden = model.project(aux)
    pos = torch.arange(s).expand(b, s)
    with torch.no_grad():
        for k in range(steps):
            tok = torch.cat([ids[:, 1 + k:], torch.zeros(b, 1 + k, dtype=ids.dtype)], 1)
            hidden, logits = model.step(tok, hidden, pos + k, attend)
            torch.testing.assert_close(logits[:, : s - steps], ref[:, :, k], atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_is_exact(tmp_path):
    torch.manual_seed(1)
    model = Eagle3Drafter(tiny_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.d2t.copy_(torch.arange(20) * 2 - torch.arange(20))
        model.t2d[::2] = True
    model.save_pretrained(tmp_path)
    again = Eagle3Drafter.from_pretrained(tmp_path)
    assert again.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert not again.embed_tokens.weight.requires_grad
