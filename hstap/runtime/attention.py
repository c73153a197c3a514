"""Grouped-query attention of a block of queries over a static cache, without repeating the key/value heads.

The G = H / H_kv query heads that share a key/value head become G·Q query rows of one attention call against
that head, so SDPA reads each cached key once (repeating the heads, as transformers does for a masked SDPA
call, copies the whole cache per layer and dominated the decode step).

    mask = group_mask(block_mask(...), groups)           # once per forward
    out = cache_attention(q, keys, values, mask, scale)  # per layer
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, Q, L) → (B, 1, G·Q, L): row g·Q + j is row j (materialised once, shared by every layer)."""
    return mask.repeat(1, 1, groups, 1)


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q (B, Q, H, D) over keys/values (B, H_kv, L, D) with `group_mask`'s (B, 1, G·Q, L) → (B, Q, H·D).

    Head h uses key/value head h // G, as transformers' repeat_kv pairs them."""
    b, s, h, d = q.shape
    kv = keys.shape[1]
    g = h // kv
    rows = q.view(b, s, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * s, d)  # (B, H_kv, G·Q, D)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)  # (B, H_kv, G·Q, D)
    return out.view(b, kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Llama's half-split convention: x (B, Q, n, D), cos/sin (B, Q, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, Q) → cos, sin (B, Q, D), computed in fp32 as transformers' rotary embedding does."""
    freqs = positions.float()[..., None] * inv_freq.float()  # (B, Q, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, Q, D)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
