"""Grouped-query attention of a block of queries over a static cache, without repeating the key/value heads.

The G = H / H_kv query heads that share a key/value head become G·Q query rows of one attention call against
that head, so SDPA reads each cached key once (repeating the heads, as transformers does for a masked SDPA
call, copies the whole cache per layer and dominated the decode step).

    cos, sin = rope_tables(positions, inv_freq, scale, dtype)       # once per forward (sin's sign folded in)
    mask = group_mask(block_mask(...), groups)                       # once per forward
    o = grouped_o(o_proj.weight, heads, kv_heads)                    # once, at load
    rows, k = rotary_qk(qkv, heads, kv_heads, cos, sin)              # per layer
    out = cache_attention(rows, keys, values, mask, scale, queries)  # per layer → F.linear(out, o)

Layout, and why: the rows are ordered (query j, group g), row j·G + g, and are written by the rotary's own last
kernel into memory laid out (B, Q, G, H_kv, D), i.e. the (B, H_kv, Q·G, D) rows with the sequence outside the
heads. cuDNN's SDPA (a Hopper GPU's choice for a masked call) allocates its output in the query's layout, so the output
is (B, Q, G·H_kv·D) without a copy, with head h = k·G + g at column (g·H_kv + k)·D; `grouped_o` reorders the output
projection's input columns to match, once. Folding the heads into rows after the rotary, and unfolding them after
SDPA, were views for one query and copies for several: 60 strided-copy launches per SmolLM2 forward at Q ≥ 2, a
tenth more than a 1-token step's cost on a GPU for a 2-token block (`bench/verify_cost.py`). Every verification
and every drafter block paid that. Other backends (a CPU's) may return a
contiguous output, and the unfold is then a copy again, with the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, Q, L) → (B, 1, Q·G, L): row j·G + g is row j (materialised once, shared by every layer)."""
    return mask.repeat_interleave(groups, dim=2)


def grouped_o(o: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The output projection's weight (H_out, H·D) with its input columns in `cache_attention`'s order: head
    h = k·G + g moves from column block h to block g·H_kv + k (a copy, made once)."""
    h_out, width = o.shape
    return o.view(h_out, kv_heads, heads // kv_heads, width // heads).transpose(1, 2).reshape(h_out, width)


def rotary_qk(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of the q and k heads of a fused projection qkv (B, Q, H + 2·H_kv, D), with cos/sin from
    `rope_tables` (B, Q, D) → (q rows (B, H_kv, Q·G, D) for `cache_attention`, k (B, Q, H_kv, D)).

    Llama's x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1]: the sign is folded into `rope_tables`' sin,
    so [x2, x1]·sin is the same product without a negation kernel, equal bit for bit (a sign flip is exact).
    Query head h = k·G + g of query j goes to row j·G + g of key/value head k (the module docstring's layout)."""
    b, s, _, d = qkv.shape
    g, half = heads // kv_heads, d // 2
    x = qkv[:, :, : heads + kv_heads]  # (B, Q, H + H_kv, D)
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    if torch.compiler.is_compiling():  # traced (the fused drafter): inductor lays the sums out by itself, and a
        # non-contiguous out= would break the graph
        straight, swapped = x * cos[:, :, None], swapped * sin[:, :, None]
        k = straight[:, :, heads:] + swapped[:, :, heads:]  # (B, Q, H_kv, D)
        q = (straight[:, :, :heads] + swapped[:, :, :heads]).view(b, s, kv_heads, g, d).transpose(2, 3)
        return q.reshape(b, s * g, kv_heads, d).transpose(1, 2), k
    # both products laid out heads first: the k heads' rows are then one dense block at any Q, and their sum runs
    # vectorised (a (B, Q, ·) layout makes them a strided slice from two queries on). The products broadcast
    # cos and sin, so they run the generic kernel in either layout.
    products = torch.empty(2, heads + kv_heads, b, s, d, dtype=qkv.dtype, device=qkv.device)
    straight, rotated = products[0].permute(1, 2, 0, 3), products[1].permute(1, 2, 0, 3)  # (B, Q, H + H_kv, D)
    torch.mul(x, cos[:, :, None], out=straight)
    torch.mul(swapped, sin[:, :, None], out=rotated)
    k = straight[:, :, heads:] + rotated[:, :, heads:]  # (B, Q, H_kv, D), dense heads first
    rows = torch.empty(b, s, g, kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    torch.add(straight[:, :, :heads].view(b, s, kv_heads, g, d), rotated[:, :, :heads].view(b, s, kv_heads, g, d),
              out=rows.transpose(2, 3))  # the sum lands in the rows' layout: no copy after it
    return rows.view(b, s * g, kv_heads, d).transpose(1, 2), k


def cache_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float, queries: int) -> torch.Tensor:
    """q rows (B, H_kv, Q·G, D) from `rotary_qk` over keys/values (B, H_kv, L, D) with `group_mask`'s
    (B, 1, Q·G, L) → (B, Q, H·D), head h = k·G + g at column block g·H_kv + k (project with `grouped_o`)."""
    b = rows.shape[0]
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)  # (B, H_kv, Q·G, D)
    return out.transpose(1, 2).reshape(b, queries, -1)  # a view when out has the rows' layout (cuDNN's)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, Q) → cos, sin (B, Q, D), computed in fp32 as transformers' rotary embedding does; sin's
    first half negated (`rotary_qk` multiplies it with [x2, x1] instead of rotate_half's [-x2, x1])."""
    freqs = positions.float()[..., None] * inv_freq.float()  # (B, Q, D/2)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)
