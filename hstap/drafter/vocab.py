"""The draft vocabulary: the N most frequent target tokens among the tokens the drafter must predict.

Two maps, in the layout SGLang and vLLM load:
- `d2t` int64 [N]: target id = draft id + d2t[draft id] (an offset, not the id itself);
- `t2d` bool [V]: which target ids are in the draft vocabulary.
"""

from __future__ import annotations

from typing import Iterable

import torch

from hstap.errors import HstapError


COUNT_CHUNK = 1 << 20  # masked tokens gathered before one bincount


def count_tokens(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Frequency of each target token over loss-masked positions (the tokens a drafter will have to propose).

    One bincount per ~1M tokens, not per sample: per sample, each count is a vocabulary-wide (49k) multi-threaded
    op, and two processes side by side (an A/B's two trainers) make their threads wait on each other at every one
    of them: the per-sample count ran a hundred times slower that way than alone, while the GPU sat held."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    pending: list[torch.Tensor] = []
    held = 0
    for sample in samples:
        pending.append(sample["input_ids"][sample["loss_mask"]])
        held += pending[-1].numel()
        if held >= COUNT_CHUNK:
            counts += torch.bincount(torch.cat(pending), minlength=vocab_size)[:vocab_size]
            pending, held = [], 0
    if pending:
        counts += torch.bincount(torch.cat(pending), minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`size` tokens by count (ties → lower id), sorted by target id; returns (d2t, t2d)."""
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise HstapError(f"draft_vocab_size={size}: expected 1..{vocab_size} (the target vocabulary)")
    # stable sort on -count keeps ascending ids among equal counts: deterministic for any data
    return _maps(torch.sort(-counts, stable=True).indices[:size], vocab_size)


def grow_draft_vocab(counts: torch.Tensor, keep_t2d: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`keep_t2d`'s tokens, all of them, plus the most frequent other tokens up to `size` (ties → lower id), sorted
    by target id; returns (d2t, t2d) as `build_draft_vocab` does. Growing an earlier drafter's vocabulary keeps
    every token its head was trained on, whatever the new data's counts say of them."""
    vocab_size, kept = counts.numel(), int(keep_t2d.sum())
    assert keep_t2d.shape == (vocab_size,), f"keep_t2d {tuple(keep_t2d.shape)} vs counts ({vocab_size},)"
    if not kept <= size <= vocab_size:
        raise HstapError(f"draft_vocab_size={size}: expected {kept}..{vocab_size} (the kept draft vocabulary .. "
                         "the target vocabulary)")
    # kept tokens go below every count (even 0), so the stable sort's first size − kept ids are all new ones
    others = torch.sort(-counts.masked_fill(keep_t2d, -1), stable=True).indices[:size - kept]
    return _maps(torch.cat([keep_t2d.nonzero().flatten(), others]), vocab_size)


def _maps(chosen: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the distinct target ids `chosen`, in any order: draft ids follow ascending target ids."""
    draft_to_target = torch.sort(chosen).values
    d2t = draft_to_target - torch.arange(chosen.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t.to(torch.int64), t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Absolute target id of every draft id."""
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def target_to_draft_ids(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft id of every target id, -1 where the target token is outside the draft vocabulary."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    lookup[draft_to_target_ids(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return lookup
