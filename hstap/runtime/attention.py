"""Grouped-query attention of a block of queries over a static cache, without repeating the key/value heads.

The G = H / H_kv query heads that share a key/value head become G·Q query rows of one attention call against
that head, so SDPA reads each cached key once (repeating the heads, as transformers does for a masked SDPA
call, copies the whole cache per layer and dominated the decode step).

    cos, sin = rope_tables(positions, inv_freq, scale, dtype)      # once per forward (sin's sign folded in)
    mask = group_mask(block_mask(...), groups)                      # once per forward
    rows, k = rotary_qk(qkv, heads, kv_heads, cos, sin)             # per layer: the q rows already grouped
    out = cache_attention(rows, keys, values, mask, scale, queries) # per layer → (B, Q, H·D)

The q rows are written in their grouped layout by the rotary's own last kernel. Folding them afterwards (a
permute + reshape) is a view for one query but a copy for several: at Q ≥ 2 that copy cost 30 non-vectorised
kernels per SmolLM2 forward on an H200, which with the output's unfold (the other 30) made a 2-token block
0.2 ms dearer than a 1-token step of 1.99 ms (`bench/verify_cost.py`, 2026-12-03). Every verification and
every drafter block paid it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, Q, L) → (B, 1, G·Q, L): row g·Q + j is row j (materialised once, shared by every layer)."""
    return mask.repeat(1, 1, groups, 1)


def rotary_qk(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of the q and k heads of a fused projection qkv (B, Q, H + 2·H_kv, D), with cos/sin from
    `rope_tables` (B, Q, D) → (q rows (B, H_kv, G·Q, D) for `cache_attention`, k (B, Q, H_kv, D)).

    Llama's x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1]: the sign is folded into `rope_tables`' sin,
    so [x2, x1]·sin is the same product without a negation kernel, equal bit for bit (a sign flip is exact).
    Query head h = k·G + g goes to row g·Q + j of key/value head k, as transformers' repeat_kv pairs them."""
    b, s, _, d = qkv.shape
    g, half = heads // kv_heads, d // 2
    x = qkv[:, :, : heads + kv_heads]  # (B, Q, H + H_kv, D)
    straight = x * cos[:, :, None]
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin[:, :, None]
    if torch.compiler.is_compiling():  # traced (the fused drafter): inductor writes the sum grouped by itself,
        # and a non-contiguous out= would break the graph
        q = (straight[:, :, :heads] + swapped[:, :, :heads]).view(b, s, kv_heads, g, d)
        return q.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * s, d), straight[:, :, heads:] + swapped[:, :, heads:]
    rows = torch.empty(b, kv_heads, g, s, d, dtype=qkv.dtype, device=qkv.device)
    # (B, Q, H, D) view of rows: merging (H_kv, G) into H is a view, so the sum lands grouped, no copy after it
    torch.add(straight[:, :, :heads], swapped[:, :, :heads], out=rows.permute(0, 3, 1, 2, 4).flatten(2, 3))
    k = straight[:, :, heads:] + swapped[:, :, heads:]  # (B, Q, H_kv, D)
    return rows.view(b, kv_heads, g * s, d), k


def cache_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float, queries: int) -> torch.Tensor:
    """q rows (B, H_kv, G·Q, D) from `rotary_qk` over keys/values (B, H_kv, L, D) with `group_mask`'s
    (B, 1, G·Q, L) → (B, Q, H·D), Q = `queries`."""
    b, kv, gq, d = rows.shape
    g = gq // queries
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)  # (B, H_kv, G·Q, D)
    return out.view(b, kv, g, queries, d).permute(0, 3, 1, 2, 4).reshape(b, queries, kv * g * d)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, Q) → cos, sin (B, Q, D), computed in fp32 as transformers' rotary embedding does; sin's
    first half negated (`rotary_qk` multiplies it with [x2, x1] instead of rotate_half's [-x2, x1])."""
    freqs = positions.float()[..., None] * inv_freq.float()  # (B, Q, D/2)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)
