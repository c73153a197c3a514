"""Top-k over a wide last dimension from its best blocks: the k largest values lie in the k blocks (of `block`
consecutive columns) with the largest maxima — a value outside them has those k maxima above it; ties only swap
equal values — so top-k runs over k·block gathered candidates instead of the whole row.

    values, ids = block_topk(x, k)               # same as x.topk(k, dim=-1) up to the order of tied ids

Why: `torch.topk` over a long row is a multi-pass radix select on CUDA (`gatherTopK`): it was most of an 8B top-32
teacher's reduction (8,192 × 128,256 logits) and ~15 % of a tree:8,8,60 decoding cycle (seven 8 × 16,384
draft-vocabulary rows; docs/benchmarks.md has the timings), while the block maxima are one bandwidth-bound
reduction and the candidates' top-k is a small one. E.g. k = 32 over 128,256 columns in blocks of 128: one pass
for 1,002 block maxima, then top-k over 32 × 128 = 4,096 candidates instead of 128,256.
"""

from __future__ import annotations

import torch

BLOCK = 128  # columns per block: k = 32 gathers 4,096 candidates, k = 8 gathers 1,024


def block_topk(x: torch.Tensor, k: int, block: int = BLOCK, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1, sorted=sorted)` (values, their column ids) through the k best blocks of the last
    dimension. A row under 2·k·block columns takes plain top-k (nothing to save). `sorted=False` returns the k
    in any order and skips top-k's closing sort (a tree's expansion ranks them itself)."""
    width = x.shape[-1]
    if 2 * k * block > width:
        top = x.topk(k, dim=-1, sorted=sorted)
        return top.values, top.indices
    flat = x.reshape(-1, width)
    whole = width // block * block
    maxes = flat[:, :whole].reshape(flat.shape[0], whole // block, block).amax(-1)  # (T, nb)
    values, ids = topk_in_best_blocks(flat, maxes, k, block, sorted)
    return values.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)


def topk_in_best_blocks(flat: torch.Tensor, maxes: torch.Tensor, k: int, block: int, sorted: bool = True,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of flat (T, V) among the columns of the k whole blocks with the largest maxima (T, nb), plus the
    tail columns [nb·block, V) that no whole block holds. → values (T, k) in flat's dtype, sorted descending, and
    their column ids (T, k); `sorted=False`: in any order. The caller computes `maxes` (the teacher gets them from
    its log-sum-exp pass). The blocks are picked unsorted: the candidates' top-k orders what it returns."""
    whole = maxes.shape[1] * block
    best = maxes.topk(k, dim=-1, sorted=False).indices  # (T, k) block numbers
    cols = (best[:, :, None] * block + torch.arange(block, device=flat.device)).flatten(1)  # (T, k·block)
    if whole < flat.shape[1]:
        tail = torch.arange(whole, flat.shape[1], device=flat.device).expand(flat.shape[0], -1)
        cols = torch.cat([cols, tail], 1)
    top = flat.gather(1, cols).topk(k, dim=-1, sorted=sorted)
    return top.values, cols.gather(1, top.indices)
