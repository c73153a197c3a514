"""The drafter's decoder layer, RMSNorm and rotary compute what transformers' Llama modules compute, weights copied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from hstap.drafter import DrafterConfig
from hstap.drafter.model import MidLayer, RMSNorm, Rotary, apply_rope

# SmolLM2-135M's attention/MLP shape and RoPE base: what the drafter mirrors for the test target
H, INTER, HEADS, KV_HEADS, HEAD_DIM, THETA, EPS = 576, 1536, 9, 3, 64, 100000.0, 1e-5


def drafter_config(theta: float = THETA) -> DrafterConfig:
    return DrafterConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS, rope_theta=theta,
                         vocab_size=64, draft_vocab_size=32, aux_layer_ids=[1, 14, 26], target_model_id="smollm2-like",
                         target_fingerprint="none", target_num_layers=30, target_hidden_size=H)


def llama_config(theta: float = THETA) -> LlamaConfig:
    return LlamaConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS,
                       rope_parameters={"rope_type": "default", "rope_theta": theta}, attn_implementation="eager")


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, nh, S, hd), k/v (B, nkv, S, hd) → (B, nh, S, hd): plain causal GQA attention."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def causal_mask(b: int, s: int) -> torch.Tensor:
    """Additive (B, 1, S, S) mask for transformers' eager attention: -inf above the diagonal."""
    return torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)


class LlamaEagle3Reference(nn.Module):
    """EAGLE-3's decoder layer assembled from transformers' modules.

    `LlamaDecoderLayer.forward` itself cannot run it: its residual is the layer's input, which here is the 2H-wide
    concat while the residual stream is the H-wide hidden state. So this takes a `LlamaDecoderLayer` for its
    modules (LlamaAttention with q/k/v widened to 2H inputs, as EAGLE-3 does; LlamaMLP; LlamaRMSNorm), adds the
    `hidden_norm` LlamaRMSNorm, and writes the two residual adds out: h' = h + attn(x), h'' = h' + mlp(norm(h'))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * config.hidden_size, old.out_features, bias=False))
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def load_drafter(self, mid: MidLayer) -> None:
        """Copy the drafter's weights under their own names (SGLang loads `midlayer.*` into the same layout)."""
        state = mid.state_dict()
        self.hidden_norm.load_state_dict({"weight": state.pop("hidden_norm.weight")})
        self.layer.load_state_dict(state, strict=True)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        cos, sin = self.rotary(x, positions)  # (B, S, hd)
        attn, _ = layer.self_attn(x, position_embeddings=(cos, sin), attention_mask=mask)  # (B, S, H)
        hidden = hidden + attn
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def random_midlayer(seed: int = 0, theta: float = THETA) -> MidLayer:
    """A MidLayer with seeded default linear init and distinct, non-unit norm weights (so swapped norms show)."""
    torch.manual_seed(seed)
    mid = MidLayer(drafter_config(theta)).eval()
    with torch.no_grad():
        for norm in (mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    return mid


def layer_inputs(b: int = 2, s: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeds (B,S,H) at embedding scale, hidden (B,S,H) at residual scale, positions (B,S)). Row 0 starts at a
    cached prefix; row 1 repeats positions like a draft tree (siblings share a depth), so RoPE's relative angles
    are not a constant shift."""
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(b, s, H, generator=gen) * 0.02
    hidden = torch.randn(b, s, H, generator=gen) * 3.0
    row0 = torch.arange(s) + 37
    row1 = torch.tensor([0, 1, 2, 3, 3, 3, 4, 4, 5, 6, 6, 7])[:s] * 5
    return embeds, hidden, torch.stack([row0, row1])[:b]


def drafter_forward(mid: MidLayer, embeds, hidden, positions, theta: float = THETA) -> torch.Tensor:
    cos, sin = Rotary(HEAD_DIM, theta)(positions, hidden.dtype)
    with torch.no_grad():
        return mid(embeds, hidden, cos, sin, causal_attend)


def test_midlayer_matches_transformers_llama_modules_fp32():
    mid = random_midlayer()
    ref = LlamaEagle3Reference(llama_config()).eval()
    ref.load_drafter(mid)
    embeds, hidden, positions = layer_inputs()
    got = drafter_forward(mid, embeds, hidden, positions)
    with torch.no_grad():
        want = ref(embeds, hidden, positions, causal_mask(*positions.shape))
    assert got.shape == hidden.shape == (2, 12, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - hidden).abs().mean() > 0.05, "attention and MLP must contribute, or the check proves little"


def swap_norms(ref: LlamaEagle3Reference, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        a, b = ref.layer.input_layernorm.weight, ref.hidden_norm.weight
        a_before = a.clone()
        a.copy_(b)
        b.copy_(a_before)
    return mask


def drop_causal_mask(ref: LlamaEagle3Reference, mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask)


def halve_rope_frequencies(ref: LlamaEagle3Reference, mask: torch.Tensor) -> torch.Tensor:
    ref.rotary.inv_freq.mul_(0.5)
    return mask


def nudge_o_proj(ref: LlamaEagle3Reference, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        ref.layer.self_attn.o_proj.weight.mul_(1.001)
    return mask


# deliberate deviations of the reference: each must break the match, so the check above can fail
DEVIATIONS = [
    pytest.param(swap_norms, id="input-and-hidden-norms-swapped"),
    pytest.param(drop_causal_mask, id="no-causal-mask"),
    pytest.param(halve_rope_frequencies, id="wrong-rope-frequencies"),
    pytest.param(nudge_o_proj, id="o-proj-off-by-0.1-percent"),
]


@pytest.mark.parametrize("deviate", DEVIATIONS)
def test_a_deviating_reference_does_not_match(deviate):
    mid = random_midlayer()
    ref = LlamaEagle3Reference(llama_config()).eval()
    ref.load_drafter(mid)
    embeds, hidden, positions = layer_inputs()
    mask = deviate(ref, causal_mask(*positions.shape))
    got = drafter_forward(mid, embeds, hidden, positions)
    with torch.no_grad():
        want = ref(embeds, hidden, positions, mask)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5)


# (dtype, input scale, rtol, atol): fp32 tight; bf16/fp16 may differ by their own rounding step
NORM_CASES = [
    pytest.param(torch.float32, 1.0, 1e-6, 1e-6, id="fp32-unit-scale"),
    pytest.param(torch.float32, 1e-3, 1e-6, 1e-6, id="fp32-tiny-inputs-where-eps-matters"),
    pytest.param(torch.float32, 1e3, 1e-6, 1e-6, id="fp32-large-inputs"),
    pytest.param(torch.bfloat16, 1.0, 1.6e-2, 1e-2, id="bf16-unit-scale"),
    pytest.param(torch.float16, 30.0, 1e-3, 1e-3, id="fp16-residual-scale"),
]


@pytest.mark.parametrize("dtype, scale, rtol, atol", NORM_CASES)
def test_rmsnorm_matches_llama_rmsnorm_and_the_formula(dtype, scale, rtol, atol):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, H, generator=gen) * scale).to(dtype)
    weight = torch.rand(H, generator=gen) + 0.5
    ours, theirs = RMSNorm(H, EPS), LlamaRMSNorm(H, eps=EPS)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        got = ours(x)
        want = theirs(x)
    assert got.dtype == want.dtype == torch.float32  # fp32 weight times the input-dtype normed value
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    x64 = x.double()
    formula = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    torch.testing.assert_close(got.double(), formula, rtol=rtol, atol=atol)
    if scale < 1e-2:  # eps dominates the mean square here: leaving it out is off by far more than the tolerance
        no_eps = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True)) * weight.double()
        assert not torch.allclose(got.double(), no_eps, rtol=rtol, atol=atol)


POSITIONS = torch.tensor([[0, 1, 2, 3, 100, 101, 2047, 4095],
                          [8191, 16383, 32767, 5, 5, 5, 6, 0]])  # (2, 8): long contexts and tree-like repeats


# both compute the angles in fp32 and round once to the output dtype: fp32 tight, bf16 within its rounding step
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_rotary_matches_llama_rotary_embedding(dtype, tol):
    ours = Rotary(HEAD_DIM, THETA)
    theirs = LlamaRotaryEmbedding(llama_config())
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq)
    cos, sin = ours(POSITIONS, dtype)  # (B, S, hd)
    want_cos, want_sin = theirs(torch.zeros(1, dtype=dtype), POSITIONS)
    assert cos.dtype == want_cos.dtype == dtype and cos.shape == want_cos.shape == (2, 8, HEAD_DIM)
    torch.testing.assert_close(cos, want_cos, rtol=tol, atol=tol)
    torch.testing.assert_close(sin, want_sin, rtol=tol, atol=tol)

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, HEADS, 8, HEAD_DIM, generator=gen).to(dtype)  # (B, nh, S, hd)
    k = torch.randn(2, KV_HEADS, 8, HEAD_DIM, generator=gen).to(dtype)  # (B, nkv, S, hd)
    want_q, want_k = apply_rotary_pos_emb(q, k, want_cos, want_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k, rtol=tol, atol=tol)


def test_rotary_rotation_preserves_norms_and_is_relative():
    """Independent of transformers: RoPE rotates pairs (i, i + hd/2), so norms are kept and q·k depends only on
    the distance between positions."""
    rot = Rotary(HEAD_DIM, THETA)
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 1, 1, HEAD_DIM, generator=gen, dtype=torch.float64).float().unbind(0)  # (1, 1, hd) each

    def rotated(x, pos):  # x (1, 1, hd) → (hd,) at position pos
        cos, sin = rot(torch.tensor([[pos]]), torch.float32)
        return apply_rope(x[None], cos, sin).reshape(-1)

    torch.testing.assert_close(rotated(q, 1234).norm(), q.norm(), rtol=1e-5, atol=1e-5)
    near = rotated(q, 10) @ rotated(k, 3)
    far = rotated(q, 1010) @ rotated(k, 1003)
    torch.testing.assert_close(near, far, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(near, rotated(q, 10) @ rotated(k, 4), rtol=1e-4, atol=1e-4)
