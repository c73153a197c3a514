"""Which draft nodes the target accepts: greedily on the device (capturable, one answer per row), or by
speculative sampling on the host (hstap.runtime.sampling's rule, row by row).

    count, path, bonus = greedy_accept(block.tokens, block.parents, depth, choice)
    path, bonus = sampled_accept(logits[b], tokens, parents, proposals, temperature, top_p, generator)

A block is [root, node 0, …, node N-1]: block row 0 is the root, row i+1 node i; `choice` (B, 1+N) is the
target's argmax at every block row, i.e. what it would emit after that row.
"""

from __future__ import annotations

import torch

from hstap.runtime.sampling import choose_child, sample, target_probs


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, depth: int,
                  choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow the target's argmax down the tree from the root: → (count (B,), path (B, depth) node indices of
    the accepted nodes, root first, padded past count, bonus (B,) the argmax after the last accepted row).

    tokens, parents (B, N): a node matches when its token is the argmax after its parent; only the first
    matching child of a node counts (as walking the tree would take it); a node is accepted when it matches
    and its parent is accepted (the root always is). E.g. parents [-1, -1, 1, 2], matches [F, T, T, F] →
    count 2, path [1, 2, ...], bonus = choice[3] (node 2's row)."""
    b, n = tokens.shape
    steps = torch.arange(n, device=tokens.device)
    match = tokens == choice.gather(1, parents + 1)  # (B, N)
    sibling = parents[:, :, None] == parents[:, None, :]  # (B, N, N) [i, j]: same parent
    earlier = steps[None, :] < steps[:, None]  # (N, N) [i, j]: j before i
    match = match & ~(sibling & earlier & match[:, None, :]).any(-1)  # only the first matching sibling
    root_child = parents < 0
    ok = match & root_child
    for _ in range(depth - 1):
        ok = match & (root_child | ok.gather(1, parents.clamp(min=0)))
    count = ok.sum(1)  # (B,) the accepted nodes form one path
    path = torch.where(ok, steps, n).sort(dim=1).values[:, :depth].clamp(max=n - 1)  # (B, depth) ascending
    last = path.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0] + 1  # (B,) block row of the deepest
    bonus = choice.gather(1, torch.where(count > 0, last, 0)[:, None])[:, 0]
    return count, path, bonus


def sampled_accept(logits: torch.Tensor, tokens: list[int], parents: list[int],
                   proposals: list[torch.Tensor | None], temperature: float, top_p: float,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """One row on the host: logits (1+N, V) of the block → (accepted node indices, bonus token).

    T = 0: follow the child equal to the target's argmax. T > 0: recursive rejection sampling over each node's
    children (sampling.choose_child; proposals[i] is node i's (V,) draft distribution, None = a point mass)."""
    path: list[int] = []
    node, row = -1, 0
    greedy = logits.argmax(-1).tolist() if temperature <= 0 else None  # (1+N,)
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if greedy is not None:
            nxt = next((c for c in kids if tokens[c] == greedy[row]), None)
            if nxt is None:
                return path, greedy[row]
        else:
            p = target_probs(logits[row], temperature, top_p)  # (V,)
            index, rest = choose_child(p, [tokens[c] for c in kids], [proposals[c] for c in kids], generator)
            if index is None:
                return path, sample(rest, generator)
            nxt = kids[index]
        path.append(nxt)
        node, row = nxt, nxt + 1
