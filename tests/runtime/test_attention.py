"""The runtime's rotary + grouped-query attention against transformers' own functions (apply_rotary_pos_emb,
repeat_kv, attention over repeated heads), bit for bit where the arithmetic is the same: the sign folded into sin,
the q rows written in their layout and the output projection's reordered columns change where values land, not
what they are. On CUDA: the attention output comes back in the rows' layout, so the unfold is a view."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv, rotate_half

from hstap.runtime.attention import cache_attention, group_mask, grouped_o, rope_tables, rotary_qk
from hstap.runtime.census import elementwise_census

HEADS, KV_HEADS, D = 9, 3, 64  # SmolLM2-135M's attention

def _tables(positions: torch.Tensor, dtype: torch.dtype):
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([positions.float()[..., None] * inv_freq] * 2, dim=-1)  # transformers' rotary embedding
    return emb.cos().to(dtype), emb.sin().to(dtype), rope_tables(positions, inv_freq, 1.0, dtype)


def test_the_rotary_runs_no_more_generic_elementwise_ops_for_a_block_than_for_one_query():
    """A verification block pays per op what a one-token step pays (hstap.runtime.census: on an H200 a
    strided or broadcast op runs the generic kernel, ~0.8 µs dearer than a vectorised one). Before 2026-12-03
    the k sum ran on a strided slice from two queries on: 30 generic launches per SmolLM2 forward."""
    def generic(queries: int) -> int:
        positions = torch.arange(queries)[None] + 300
        qkv = torch.randn(1, queries, HEADS + 2 * KV_HEADS, D)
        _, _, (cos, sin) = _tables(positions, torch.float32)
        counts = elementwise_census(lambda: rotary_qk(qkv, HEADS, KV_HEADS, cos, sin))
        return sum(n for (_, layout), n in counts.items() if layout != "dense")

    assert generic(4) == generic(16) == generic(1) == 3  # the two products (they broadcast cos, sin) and the q sum


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
    assert rows.shape == (2, KV_HEADS, queries * g, D)
    # row j·G + g of key/value head k is query j's head k·G + g
    assert torch.equal(rows.reshape(2, KV_HEADS, queries, g, D).transpose(2, 3).reshape(2, HEADS, queries, D), want_q)
    assert torch.equal(got_k.transpose(1, 2), want_k)
    assert torch.equal(my_sin * torch.cat([-torch.ones(D // 2), torch.ones(D // 2)]).to(dtype), sin)
    assert torch.equal(rotate_half(q), torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1))


def _attention_then_o(device: str, dtype: torch.dtype, queries: int = 4, length: int = 37):
    """(runtime: rows → cache_attention → grouped_o projection, reference: repeated heads → SDPA → o_proj), and
    the raw SDPA output of the runtime's rows."""
    torch.manual_seed(1)
    qkv = torch.randn(2, queries, HEADS + 2 * KV_HEADS, D, device=device).to(dtype)
    positions = torch.arange(queries, device=device)[None].expand(2, -1)
    _, _, (cos, sin) = _tables(positions.cpu(), dtype)
    rows, _ = rotary_qk(qkv, HEADS, KV_HEADS, cos.to(device), sin.to(device))
    keys, values = (torch.randn(2, KV_HEADS, length, D, device=device).to(dtype) for _ in range(2))
    mask = torch.zeros(2, 1, queries, length, device=device, dtype=dtype)
    mask.masked_fill_(torch.rand(2, 1, queries, length, device=device) < 0.3, torch.finfo(dtype).min)
    o = torch.randn(HEADS * D, HEADS * D, device=device).to(dtype)  # (H_out, H·D)
    got = torch.nn.functional.linear(
        cache_attention(rows, keys, values, group_mask(mask, HEADS // KV_HEADS), D ** -0.5, queries),
        grouped_o(o, HEADS, KV_HEADS))
    q = rows.reshape(2, KV_HEADS, queries, HEADS // KV_HEADS, D).transpose(2, 3).reshape(2, HEADS, queries, D)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(keys, 3), repeat_kv(values, 3), mask,
                                                            scale=D ** -0.5)
    want = torch.nn.functional.linear(want.transpose(1, 2).reshape(2, queries, HEADS * D), o)
    raw = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, group_mask(mask, HEADS // KV_HEADS),
                                                           scale=D ** -0.5)
    return got, want, raw


def test_cache_attention_equals_repeated_heads_attention():
    """Grouped rows over the un-repeated cache, projected by the reordered o = every query head over its repeated
    key/value head, projected by the original o."""
    got, want, _ = _attention_then_o("cpu", torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_attention_output_keeps_the_rows_layout():
    """The point of the layout: SDPA's output (bf16, masked: cuDNN on an H200) comes back in the rows' memory
    order, so `cache_attention`'s unfold is a view (no copy kernel), and the result is still right."""
    got, want, raw = _attention_then_o("cuda", torch.bfloat16)
    assert raw.transpose(1, 2).is_contiguous(), raw.stride()
    torch.testing.assert_close(got.float(), want.float(), atol=0.25, rtol=0.05)  # bf16 sums over 576 inputs


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
