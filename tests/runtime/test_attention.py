"""The runtime's rotary + grouped-query attention against transformers' own functions (apply_rotary_pos_emb,
repeat_kv, eager attention), bit for bit where the arithmetic is the same: the sign folded into sin and the q
rows written grouped change where values land, not what they are."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv, rotate_half

from hstap.runtime.attention import cache_attention, rope_tables, rotary_qk

HEADS, KV_HEADS, D = 9, 3, 64  # SmolLM2-135M's attention


def _tables(positions: torch.Tensor, dtype: torch.dtype):
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([positions.float()[..., None] * inv_freq] * 2, dim=-1)  # transformers' rotary embedding
    return emb.cos().to(dtype), emb.sin().to(dtype), rope_tables(positions, inv_freq, 1.0, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 4, 7])
def test_rotary_rows_equal_transformers_bit_for_bit(dtype, queries):
    torch.manual_seed(0)
    positions = torch.arange(queries)[None] + torch.tensor([[300], [5]])  # (2, Q): two rows, other positions
    qkv = torch.randn(2, queries, HEADS + 2 * KV_HEADS, D).to(dtype)
    cos, sin, (my_cos, my_sin) = _tables(positions, dtype)
    q, k = qkv[:, :, :HEADS].transpose(1, 2), qkv[:, :, HEADS:HEADS + KV_HEADS].transpose(1, 2)  # (B, n, Q, D)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rows, got_k = rotary_qk(qkv, HEADS, KV_HEADS, my_cos, my_sin)
    g = HEADS // KV_HEADS
    assert torch.equal(rows.view(2, KV_HEADS, g, queries, D).flatten(1, 2), want_q)  # head k·G + g, row g·Q + j
    assert torch.equal(got_k.transpose(1, 2), want_k)
    assert torch.equal(my_sin * torch.cat([-torch.ones(D // 2), torch.ones(D // 2)]).to(dtype), sin)
    assert torch.equal(rotate_half(q), torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1))


def test_cache_attention_equals_repeated_heads_attention():
    """Grouped rows over the un-repeated cache = every query head over its repeated key/value head."""
    torch.manual_seed(1)
    queries, length = 4, 37
    rows = torch.randn(2, KV_HEADS, HEADS // KV_HEADS * queries, D)
    keys, values = torch.randn(2, KV_HEADS, length, D), torch.randn(2, KV_HEADS, length, D)
    mask = torch.zeros(2, 1, queries, length).masked_fill_(torch.rand(2, 1, queries, length) < 0.3, -1e9)
    got = cache_attention(rows, keys, values, mask.repeat(1, 1, HEADS // KV_HEADS, 1), D ** -0.5, queries)
    q = rows.view(2, KV_HEADS, HEADS // KV_HEADS, queries, D).flatten(1, 2)  # (B, H, Q, D)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(keys, 3), repeat_kv(values, 3), mask,
                                                            scale=D ** -0.5)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(2, queries, HEADS * D), atol=1e-5, rtol=1e-5)


def test_rotary_traces_whole_and_agrees_with_eager():
    """Under torch.compile (the fused drafter's bodies) the grouped write is not an out= call, which would break
    the graph; compiled and eager give the same rows."""
    import torch._dynamo as dynamo

    qkv = torch.randn(1, 4, HEADS + 2 * KV_HEADS, D)
    _, _, (cos, sin) = _tables(torch.arange(4)[None], torch.float32)
    explained = dynamo.explain(lambda *a: rotary_qk(*a))(qkv, HEADS, KV_HEADS, cos, sin)
    assert explained.graph_break_count == 0
    compiled = torch.compile(rotary_qk, dynamic=False, backend="eager")(qkv, HEADS, KV_HEADS, cos, sin)
    for got, want in zip(compiled, rotary_qk(qkv, HEADS, KV_HEADS, cos, sin)):
        assert torch.equal(got, want)
