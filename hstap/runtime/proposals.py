"""Draft proposals on the device, in fixed shapes (so a CUDA graph can capture them): the drafter's chain, its
EAGLE-2 tree, and prompt lookup (n-gram). Each fills a `Block` below every row's root.

Alignment is the training-time test's (hstap.train.ttt). With L committed tokens in row b's target cache (columns
[start, write_at)) and the root (the newest committed token, not in the cache yet) at position L:
- the drafter cache holds the step-0 entry of every position t < L (target hidden h_t, token t+1) in t's column;
  the entry at L-1 pairs h_{L-1} with the root, and its output (`Drafts.hidden`/`logits`) predicts depth 1;
- a draft node at depth d is a step-d query at rotary position L-1+d, fed with its parent's output hidden and
  its own token; it sees every step-0 entry, its ancestors' step entries and its own. Step entries of a round
  are written past write_at (columns the next verification overwrites), never among the step-0 entries.

    extend(lean, drafts, slot, aux, tokens, count)            # after prefill, and after every verification
    draft_tree(lean, drafts, slot, block, depth=8, topk=8)    # EAGLE-2, rerank to block's node count
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstap.runtime.lean_drafter import LeanDrafter
from hstap.runtime.kv import KVCache, block_columns, block_mask
from hstap.topk import block_topk


@dataclass
class Block:
    """Static buffers of one draft: N nodes below each row's root, parents before children."""

    tokens: torch.Tensor  # (B, N) target ids
    parents: torch.Tensor  # (B, N) node index of the parent, -1 = the root
    depths: torch.Tensor  # (B, N) 1 = child of the root
    q: torch.Tensor | None = None  # (B, N, Vd) draft distribution a node was sampled from (sampled chains)
    scores: torch.Tensor | None = None  # (B, N) a tree node's cumulative draft log-prob (for inspection)

    @classmethod
    def chain(cls, batch: int, n: int, device: torch.device) -> "Block":
        steps = torch.arange(n, device=device)
        return cls(tokens=torch.zeros(batch, n, dtype=torch.long, device=device),
                   parents=(steps - 1).expand(batch, n).contiguous(), depths=(steps + 1).expand(batch, n).contiguous())


@dataclass
class Drafts:
    """The drafter's per-slot state: its cache and the newest step-0 output of every row (the root's)."""

    kv: KVCache
    hidden: torch.Tensor  # (B, H)
    logits: torch.Tensor  # (B, Vd)


def _span(slot, extra: int) -> int:
    """The cache prefix a drafter forward attends to (`Slot.span`; the whole cache for slot stand-ins)."""
    return slot.span(extra) if hasattr(slot, "span") else slot.length


def _causal(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def extend(lean: LeanDrafter, drafts: Drafts, slot, aux: torch.Tensor, tokens: torch.Tensor,
           count: torch.Tensor, padded_start: bool = False) -> None:
    """Append step-0 entries: row b gets count[b] of them, in the columns just before write_at (the tokens the
    target committed last). aux (B, S, n·H_target) at those positions, tokens (B, S) the committed token after
    each; entries past count[b] are written beyond write_at and ignored. Updates the root's output of every row
    with count > 0. `padded_start`: the block is the left-padded prompt (count = S), whose padding sees nothing."""
    b, s = tokens.shape
    base = slot.write_at - count  # (B,) column of the first new entry
    tree = _causal(s, tokens.device)  # (S, S)
    if padded_start:
        tree = tree & (torch.arange(s, device=tokens.device)[None, None] >= slot.start[:, None, None])  # (B, S, S)
    positions = (base - slot.start)[:, None] + torch.arange(s, device=tokens.device)
    mask = block_mask(slot.start, base, _span(slot, s), tree, lean.dtype)  # (B, 1, S, L' ≤ L)
    hidden, logits = lean.forward(tokens, lean.project(aux), positions.clamp(min=0), drafts.kv,
                                  block_columns(base, s, slot.length), mask)  # (B, S, H), (B, S, Vd)
    last = (count - 1).clamp(min=0)[:, None, None]  # (B, 1, 1) the newest entry
    keep = (count > 0)[:, None]  # (B, 1)
    drafts.hidden.copy_(torch.where(keep, hidden.gather(1, last.expand(b, 1, hidden.shape[-1]))[:, 0],
                                    drafts.hidden))
    drafts.logits.copy_(torch.where(keep, logits.gather(1, last.expand(b, 1, logits.shape[-1]))[:, 0],
                                    drafts.logits))


def _step(lean: LeanDrafter, drafts: Drafts, slot, ids: torch.Tensor, hidden: torch.Tensor, depth: int,
          first: int, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k nodes at `depth` as round entries first..first+k-1 (ids (B, k), parents' hidden (B, k, H)); seen
    (B, k, R) or (k, R): the round entries each sees (ancestors + itself). → (hidden (B, k, H), logits)."""
    k = ids.shape[1]
    positions = (slot.positions - 1 + depth)[:, None].expand(-1, k)  # (B, k)
    mask = block_mask(slot.start, slot.write_at, _span(slot, seen.shape[-1]), seen, lean.dtype)  # (B, 1, k, L')
    cols = block_columns(slot.write_at + first, k, slot.length)  # (B, k)
    return lean.forward(ids, hidden, positions, drafts.kv, cols, mask)


def draft_chain(lean: LeanDrafter, drafts: Drafts, slot, block: Block, temperature: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> None:
    """K tokens in a line: the drafter's argmax, or (temperature (B,) > 0) a sample from softmax(logits / T)
    whose distribution is kept in block.q for the acceptance rule. Rows with T = 0 stay greedy."""
    steps = block.tokens.shape[1]
    hidden, logits = drafts.hidden[:, None], drafts.logits[:, None]  # (B, 1, H), (B, 1, Vd)
    for k in range(steps):
        pick = logits[:, 0].argmax(-1)  # (B,) draft ids
        if temperature is not None:
            q = torch.softmax(logits[:, 0].float() / temperature.clamp_min(1e-5)[:, None], -1)  # (B, Vd)
            sampled = torch.multinomial(q, 1, generator=generator)[:, 0]
            pick = torch.where(temperature > 0, sampled, pick)
            block.q[:, k] = q
        block.tokens[:, k] = lean.target_ids[pick]
        if k + 1 < steps:
            seen = _causal(steps - 1, pick.device)[k: k + 1]  # (1, R): the earlier round entries and itself
            hidden, logits = _step(lean, drafts, slot, block.tokens[:, k: k + 1], hidden, k + 1, k, seen)


def draft_tree(lean: LeanDrafter, drafts: Drafts, slot, block: Block, depth: int, topk: int,
               scale: torch.Tensor | None = None) -> None:
    """EAGLE-2 dynamic tree, then rerank to block's N nodes.

    Depth 1 is the root's top-k. At each further depth the k frontier nodes run one batched drafter step, each
    proposes its top-k children (k² candidates, scored parent + log q), and the k best become the next
    frontier. Every scored candidate then competes for the N slots: a stable sort by score keeps a parent
    before its children (a child's score is its parent's plus a log-prob ≤ 0, and it comes later), so the kept
    set is closed under ancestors. scale (B, 1): temperatures that sharpen or flatten the scores (T > 0)."""
    b, device = block.tokens.shape[0], block.tokens.device
    rounds = (depth - 1) * topk  # step entries of the round
    logp = torch.log_softmax(drafts.logits.float() / (1 if scale is None else scale), -1)  # (B, Vd)
    # (B, k), in any order (the tree ranks candidates by score itself; unsorted skips top-k's closing sort): a
    # full-row topk is a multi-pass radix select over the whole draft vocabulary (hstap.topk)
    top_values, top_ids = block_topk(logp, topk, sorted=False)
    ids, scores = [top_ids], [top_values]
    parents = [torch.full((b, topk), -1, dtype=torch.long, device=device)]
    depths = [torch.ones(b, topk, dtype=torch.long, device=device)]
    frontier = torch.arange(topk, device=device).expand(b, topk)  # (B, k) candidate indices
    drafted, score = top_ids, top_values  # (B, k) the frontier's draft ids and scores
    hidden = drafts.hidden[:, None].expand(b, topk, -1)  # (B, k, H) the frontier's parents' output
    entry = torch.full((b, topk), -1, dtype=torch.long, device=device)  # round entry of each frontier's parent
    seen = torch.zeros(b, rounds, rounds, dtype=torch.bool, device=device)  # (B, R, R) round ancestry
    eye = torch.eye(rounds, dtype=torch.bool, device=device)
    for d in range(1, depth):
        first = (d - 1) * topk
        inherit = seen.gather(1, entry.clamp(min=0)[:, :, None].expand(b, topk, rounds)) & (entry >= 0)[:, :, None]
        seen[:, first: first + topk] = eye[first: first + topk] | inherit  # (B, k, R)
        out_hidden, logits = _step(lean, drafts, slot, lean.target_ids[drafted], hidden, d, first,
                                   seen[:, first: first + topk])
        logp = torch.log_softmax(logits.float() / (1 if scale is None else scale[:, :, None]), -1)  # (B, k, Vd)
        top_values, top_ids = block_topk(logp, topk, sorted=False)  # (B, k, k)
        cand = (score[:, :, None] + top_values).flatten(1)  # (B, k²)
        base = topk + (d - 1) * topk * topk
        ids.append(top_ids.flatten(1))
        scores.append(cand)
        parents.append(frontier[:, :, None].expand(-1, -1, topk).reshape(b, topk * topk))  # each parent k times
        depths.append(torch.full((b, topk * topk), d + 1, dtype=torch.long, device=device))
        best = cand.topk(topk, dim=-1, sorted=False).indices  # (B, k)
        frontier = base + best
        drafted, score = top_ids.flatten(1).gather(1, best), cand.gather(1, best)
        hidden = out_hidden.gather(1, (best // topk)[:, :, None].expand(-1, -1, out_hidden.shape[-1]))
        entry = first + best // topk
    _rerank(lean, block, torch.cat(ids, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depths, 1))


def _rerank(lean: LeanDrafter, block: Block, ids: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor) -> None:
    """Keep the N best of C candidates (B, C), in candidate order (parents first); parents re-indexed.

    E.g. kept candidates [0, 2, 9] with candidate parents [-1, -1, 2] → block parents [-1, -1, 1]."""
    n = block.tokens.shape[1]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # (B, N)
    kept = order.sort(dim=1).values  # (B, N) ascending: topological
    inverse = torch.full_like(ids, -1).scatter_(1, kept, torch.arange(n, device=ids.device).expand_as(kept))
    parent = parents.gather(1, kept)  # (B, N) candidate index or -1
    block.tokens.copy_(lean.target_ids[ids.gather(1, kept)])
    block.parents.copy_(torch.where(parent >= 0, inverse.gather(1, parent.clamp(min=0)), -1))
    block.depths.copy_(depths.gather(1, kept))
    if block.scores is not None:
        block.scores.copy_(scores.gather(1, kept))


def draft_ngram(history: torch.Tensor, slot, block: Block, match: int) -> torch.Tensor:
    """Prompt lookup: the K tokens that followed the latest earlier occurrence of the context's last n tokens,
    n = match .. 1 (the longest found wins); history (B, L) holds row b's tokens by column, the root at
    write_at. Positions past the context repeat the root; no match proposes the root K times (rejected).
    Returns each row's match length n (B,), 0 where nothing matched."""
    b, length = history.shape
    k = block.tokens.shape[1]
    col = torch.arange(length, device=history.device)  # (L,) window start p
    root = slot.write_at.clamp(max=length - 1)  # (B,)
    found = torch.full((b,), -1, dtype=torch.long, device=history.device)  # (B,) column after the match
    matched = torch.zeros(b, dtype=torch.long, device=history.device)  # (B,) its length
    for n in range(1, match + 1):
        hit = (col[None] >= slot.start[:, None]) & (col[None] + n <= root[:, None])  # window ends before root
        for i in range(n):
            window = history.gather(1, (col + i).clamp(max=length - 1).expand(b, length))  # (B, L)
            suffix = history.gather(1, (root - n + 1 + i).clamp(min=0)[:, None])  # (B, 1)
            hit = hit & (window == suffix)
        latest = torch.where(hit, col[None], -1).amax(1)  # (B,)
        hit_n = (latest >= 0) & (root - n + 1 >= slot.start)
        found = torch.where(hit_n, latest + n, found)
        matched = torch.where(hit_n, n, matched)
    follow = torch.where(found[:, None] >= 0, found[:, None] + torch.arange(k, device=history.device), root[:, None])
    block.tokens.copy_(history.gather(1, torch.minimum(follow, root[:, None])))
    return matched
