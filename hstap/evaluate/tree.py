"""The draft tree (chain or EAGLE-2 dynamic tree) and the attention masks that verify it.

A draft tree hangs below the *root*: the last committed token, which the target has not processed yet. Node i
holds a proposed token at depth `depth[i]` (1 = the token right after the root) and its parent's index (-1 = the
root). Nodes are in topological order (every parent before its children), so a verification forward can feed
`[root, node 0, node 1, ...]` with position_ids `L + [0, depth...]` and a mask in which each node sees the
committed prefix, the root, its ancestors and itself.

Draft shapes (`chain:3`, `tree:8,8,60`) are parsed in hstap/evaluate/shapes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch



@dataclass
class DraftTree:
    """Proposed tokens (target ids) below the root, parents before children.

    `proposals[i]` is the distribution (over the target vocabulary) node i was *sampled* from, or None when the
    node was chosen deterministically (top-k); the sampling acceptance rule treats None as a point mass."""

    tokens: list[int]
    parents: list[int]
    proposals: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.proposals:
            self.proposals = [None] * len(self.tokens)
        assert len(self.tokens) == len(self.parents) == len(self.proposals), "tree fields differ in length"
        assert all(p < i for i, p in enumerate(self.parents)), "parents must precede their children"

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: row i is True at i and at every ancestor of i (the root excluded)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]  # parents come first, so row p is complete
    return mask


def verify_mask(parents: list[int], prefix_len: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask (1, 1, 1+N, prefix_len+1+N) for a forward over [root, nodes] after `prefix_len` cached keys.

    Every row sees the prefix and the root; node rows also see their ancestors and themselves. Blocked entries hold
    the dtype's most negative finite value (not -inf) so eager and SDPA attention never produce NaN."""
    n = len(parents)
    allowed = torch.zeros(1 + n, prefix_len + 1 + n, dtype=torch.bool)
    allowed[:, : prefix_len + 1] = True
    allowed[1:, prefix_len + 1:] = ancestor_mask(parents)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def rerank(tokens: list[int], parents: list[int], scores: list[float], nodes: int) -> DraftTree:
    """EAGLE-2's final step: keep the `nodes` best candidates by cumulative log-prob.

    Candidates (parents index into the same lists, -1 = root; parents listed before children) are ranked by
    (score desc, depth asc). A child's score is its parent's plus a log-prob ≤ 0 and it is deeper, so it always
    ranks after its parent: any top set is closed under ancestors. Kept nodes are returned depth by depth."""
    cand = DraftTree(tokens, parents)
    depths = cand.depths
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:nodes]
    kept = set(order)
    assert all(parents[i] < 0 or parents[i] in kept for i in kept), "top candidates are not closed under ancestors"
    order.sort(key=lambda i: (depths[i], -scores[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree(tokens=[tokens[i] for i in order],
                     parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in order])
