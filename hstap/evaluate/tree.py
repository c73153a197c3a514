"""Draft shapes (chain, EAGLE-2 dynamic tree), the draft tree itself, and the attention masks that verify it.

A draft tree hangs below the *root*: the last committed token, which the target has not processed yet. Node i
holds a proposed token at depth `depth[i]` (1 = the token right after the root) and its parent's index (-1 = the
root). Nodes are in topological order (every parent before its children), so a verification forward can feed
`[root, node 0, node 1, ...]` with position_ids `L + [0, depth...]` and a mask in which each node sees the
committed prefix, the root, its ancestors and itself.

    shape = DraftShape.parse("tree:8,8,60")     # depth 8, top-8 children per node, 60 draft tokens
    shape = DraftShape.parse("chain:3")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from hstap.errors import HstapError


class DraftShape(BaseModel):
    """How much to draft per verification. A chain of K is the tree (depth K, top-1, K nodes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["chain", "tree"]
    depth: int = Field(ge=1)
    topk: int = Field(default=1, ge=1)
    nodes: int = Field(ge=1)

    @classmethod
    def parse(cls, spec: str) -> "DraftShape":
        """`chain:K` or `tree:DEPTH,TOPK,NODES` (see SHAPES)."""
        kind, _, args = spec.partition(":")
        if kind not in SHAPES:
            raise HstapError(f"draft shape {spec!r}: unknown kind {kind!r}; expected one of "
                             f"{', '.join(SHAPES[k][0] for k in SHAPES)}")
        usage, build = SHAPES[kind]
        try:
            numbers = [int(x) for x in args.split(",")]
            return build(*numbers)
        except (ValueError, TypeError) as exc:
            raise HstapError(f"draft shape {spec!r}: expected {usage} with positive integers "
                             f"({str(exc).splitlines()[0]})") from None

    @property
    def spec(self) -> str:
        return f"chain:{self.depth}" if self.kind == "chain" else f"tree:{self.depth},{self.topk},{self.nodes}"

    @property
    def label(self) -> str:
        if self.kind == "chain":
            return f"chain {self.depth}"
        return f"tree depth {self.depth}, top-{self.topk}, {self.nodes} nodes"


def _chain(steps: int) -> DraftShape:
    return DraftShape(kind="chain", depth=steps, topk=1, nodes=steps)


def _tree(depth: int, topk: int, nodes: int) -> DraftShape:
    most = topk + (depth - 1) * topk * topk  # every candidate EAGLE-2 scores
    if depth < 1 or topk < 1 or not 1 <= nodes <= most:
        raise ValueError(f"need depth ≥ 1, topk ≥ 1 and 1 ≤ nodes ≤ topk + (depth-1)·topk² = {most}")
    return DraftShape(kind="tree", depth=depth, topk=topk, nodes=nodes)


# The one registry of draft shapes: kind → (usage, builder from the integers after the colon).
SHAPES = {
    "chain": ("chain:K", _chain),
    "tree": ("tree:DEPTH,TOPK,NODES", _tree),
}


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
