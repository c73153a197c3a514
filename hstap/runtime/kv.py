"""A preallocated KV cache whose rows advance independently, and the block masks that go with it.

Layout: one tensor (2·layers, B, H_kv, L, D): the keys of layer i at 2i, its values at 2i+1, so that moving the
accepted rows of a draft tree into place is one gather and one scatter for every layer at once. Row b holds its
tokens in columns [start[b], write_at[b]): prompts are left-padded (start = the padding), and each row then grows
by its own count (speculative decoding accepts a different number of tokens per row). A block of Q new tokens
(a decode token, [root, chain], [root, tree]) is written at columns write_at[b] + 0..Q-1 and attends, per query,
to the row's prefix plus the block entries its `tree` row allows.

Every index is clamped into the buffer: a row that over-runs its reservation writes garbage into the last column
instead of faulting the device (the host sizes the buffer so that this never happens to a row it still reads).
"""

from __future__ import annotations

import torch

KV_WRITES = ("scatter", "index_copy")


class KVCache:
    """Keys and values of every layer, (2·layers, B, H_kv, L, D), zero-initialised (a masked slot is never NaN).

    `write_form`: how a forward's new keys and values go in. "scatter" (default): one scatter per tensor along
    the column dim, with a (B, H_kv, Q, D) index; "index_copy": one row copy per tensor into the (B·H_kv·L, D)
    view, with a (B·H_kv·Q,) index — an A/B on a GPU (bench/verify_cost.py section 6, bench/spec_decode.py
    --kv-write), since the scatter kernel's cost grows with Q where a row copy's barely does."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, write_form: str = "scatter"):
        if write_form not in KV_WRITES:
            raise ValueError(f"write_form must be one of {', '.join(KV_WRITES)}, got {write_form!r}")
        self.data = torch.zeros(2 * layers, batch, kv_heads, length, head_dim, dtype=dtype, device=device)
        self.length, self.write_form = length, write_form

    def rows(self, first: int, end: int) -> "KVCache":
        """Rows [first, end) as a KVCache over this one's memory (a view, no copy): a forward over those rows
        writes their keys and values in place (the lean prefill of some rows of a slot)."""
        if not 0 <= first < end <= self.data.shape[1]:
            raise ValueError(f"rows [{first}, {end}) are not inside the cache's {self.data.shape[1]} rows")
        view = KVCache.__new__(KVCache)
        view.data, view.length, view.write_form = self.data[:, first:end], self.length, self.write_form
        return view

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[2 * layer]  # (B, H_kv, L, D)

    def values(self, layer: int) -> torch.Tensor:
        return self.data[2 * layer + 1]

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, H_kv, Q, D) into the columns `index` names (`write_index`, in this cache's form)."""
        if self.write_form == "index_copy":  # a layer's (B, H_kv, L, D) block is contiguous, also in a rows() view
            d = k.shape[-1]
            self.data[2 * layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
            self.data[2 * layer + 1].view(-1, d).index_copy_(0, index, v.reshape(-1, d))
            return
        self.data[2 * layer].scatter_(2, index, k)
        self.data[2 * layer + 1].scatter_(2, index, v)

    def write_index(self, cols: torch.Tensor) -> torch.Tensor:
        """(B, Q) columns → the index `write` takes (built once per forward): "scatter" (B, H_kv, Q, D), the
        column per element; "index_copy" (B·H_kv·Q,), the row of (b, h, column) in a layer's (B·H_kv·L, D) view,
        in k.reshape(-1, D)'s order."""
        _, b, h, length, d = self.data.shape
        if self.write_form == "index_copy":
            rows = torch.arange(b, device=cols.device)[:, None, None] * (h * length) \
                + torch.arange(h, device=cols.device)[None, :, None] * length + cols[:, None, :]  # (B, H_kv, Q)
            return rows.reshape(-1)
        return cols[:, None, :, None].expand(b, h, cols.shape[1], d)

    def load_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                  width: int) -> None:
        """Copy a prefill's (k, H_kv, width, D) keys/values into columns [0, width) of the rows `rows` (k,)."""
        self.data[2 * layer][rows, :, :width] = keys
        self.data[2 * layer + 1][rows, :, :width] = values

    def commit(self, write_at: torch.Tensor, rows: torch.Tensor) -> None:
        """Move block entries into place: column write_at + rows[b, j] → write_at + j, for every layer.

        write_at (B,), rows (B, R) ascending with rows[b, j] ≥ j (an accepted tree path, root first); e.g. the
        path [0, 2, 5] of a block at column 10 moves columns 12 → 11 and 15 → 12. Gathered first, then
        scattered, so overlapping moves are safe."""
        n, b, h, _, d = self.data.shape
        r = rows.shape[1]
        src = (write_at[:, None] + rows).clamp(max=self.length - 1)  # (B, R)
        dst = (write_at[:, None] + torch.arange(r, device=rows.device)).clamp(max=self.length - 1)  # (B, R)
        moved = self.data.gather(3, src[None, :, None, :, None].expand(n, b, h, r, d))  # (2·layers, B, H_kv, R, D)
        self.data.scatter_(3, dst[None, :, None, :, None].expand(n, b, h, r, d), moved)


def block_columns(write_at: torch.Tensor, q: int, length: int) -> torch.Tensor:
    """(B,) write positions → the (B, Q) columns of a Q-token block."""
    return (write_at[:, None] + torch.arange(q, device=write_at.device)).clamp(max=length - 1)


def block_mask(start: torch.Tensor, write_at: torch.Tensor, length: int, tree: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (B, 1, Q, L) for queries over a block of W entries written at write_at: each query sees its
    row's prefix [start, write_at) and the block entries j' with tree[b, j, j'] (tree (B, Q, W) bool, or (Q, W)
    for all rows; Q = W when the queries are the block itself, Q < W when a few of its entries query).

    Blocked entries hold the dtype's most negative finite value, not -inf: a query that sees nothing (a padding
    row, a dummy batch row) averages finite garbage instead of producing a NaN that would poison the cache."""
    b, q, w = write_at.shape[0], tree.shape[-2], tree.shape[-1]
    col = torch.arange(length, device=write_at.device)  # (L,)
    rel = col[None] - write_at[:, None]  # (B, L) column relative to the block
    prefix = (col[None] >= start[:, None]) & (rel < 0)  # (B, L)
    inside = (rel >= 0) & (rel < w)  # (B, L)
    tree = tree.expand(b, q, w)
    in_tree = tree.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(b, q, length))  # (B, Q, L): tree[b, j, rel]
    allowed = prefix[:, None] | (inside[:, None] & in_tree)  # (B, Q, L)
    mask = torch.zeros(b, 1, q, length, dtype=dtype, device=write_at.device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, N) parent indices (-1 = the root; parents before children) → (B, N, N) bool: node i sees i and its
    ancestors. `depth` bounds the tree's depth (one gather per level; a fixed count, so it can be captured)."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    seen = eye
    has_parent = (parents >= 0)[:, :, None]  # (B, N, 1)
    index = parents.clamp(min=0)[:, :, None].expand(b, n, n)
    for _ in range(depth - 1):
        seen = eye | (has_parent & seen.gather(1, index))  # row i |= row parent(i)
    return seen


def with_root(tree: torch.Tensor) -> torch.Tensor:
    """(B, N, N) node visibility → (B, 1+N, 1+N) for the block [root, nodes]: everything sees the root."""
    b, n, _ = tree.shape
    out = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=tree.device)
    out[:, :, 0] = True
    out[:, 1:, 1:] = tree
    return out
