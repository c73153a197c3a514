"""Draft shapes — how much to draft per verification — and their one registry; no torch, so configs can check them.

    shape = DraftShape.parse("tree:8,8,60")     # depth 8, top-8 children per node, 60 draft tokens
    shape = DraftShape.parse("chain:3")         # the drafter's argmax, 3 steps
    shape = DraftShape.parse("ngram:3")         # prompt lookup: the 3 tokens after the latest match of the
                                                # context's last 3, 2 or 1 tokens (longest first); ngram:K,N
    shape = DraftShape.parse("hybrid:3")        # chain:3 from the drafter, but prompt lookup's 3 tokens in the
                                                # rows whose last 3 tokens occurred before (copying); hybrid:K,N
    shape = DraftShape.parse("chain:3@eager")   # the same draft, the drafter's captured steps without fused
                                                # kernels (the A/B of hstap.runtime.lean_drafter's compiled forward)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hstap.errors import HstapError


class DraftShape(BaseModel):
    """How much to draft per verification. A chain of K is the tree (depth K, top-1, K nodes); an n-gram draft is
    a chain that prompt lookup proposes (`match`: the longest context suffix it looks up; no drafter needed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["chain", "tree", "ngram", "hybrid"]
    depth: int = Field(ge=1)
    topk: int = Field(default=1, ge=1)
    nodes: int = Field(ge=1)
    match: int = Field(default=0, ge=0)
    eager: bool = False  # the drafter's steps as plain kernels even inside CUDA graphs (`@eager`)

    @classmethod
    def parse(cls, spec: str) -> "DraftShape":
        """`chain:K` or `tree:DEPTH,TOPK,NODES` (see SHAPES), optionally followed by `@eager`."""
        spec, at, kernels = spec.partition("@")
        if at and kernels != "eager":
            raise HstapError(f"draft shape {spec}@{kernels}: the only suffix is @eager (the drafter's steps "
                             "without fused kernels)")
        shape = cls._parse(spec)
        return shape.model_copy(update={"eager": True}) if at else shape

    @classmethod
    def _parse(cls, spec: str) -> "DraftShape":
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
        return self._core_spec + ("@eager" if self.eager else "")

    @property
    def _core_spec(self) -> str:
        if self.kind in ("ngram", "hybrid"):
            return f"{self.kind}:{self.depth}" + (f",{self.match}" if self.match != NGRAM_MATCH else "")
        return f"chain:{self.depth}" if self.kind == "chain" else f"tree:{self.depth},{self.topk},{self.nodes}"

    @property
    def label(self) -> str:
        return self._core_label + (" (drafter steps without fused kernels)" if self.eager else "")

    @property
    def _core_label(self) -> str:
        if self.kind == "chain":
            return f"chain {self.depth}"
        if self.kind == "ngram":
            return f"ngram {self.depth} (match ≤ {self.match})"
        if self.kind == "hybrid":
            return f"chain {self.depth}, prompt lookup where the last {self.match} tokens recur"
        return f"tree depth {self.depth}, top-{self.topk}, {self.nodes} nodes"

    @property
    def uses_drafter(self) -> bool:
        return self.kind != "ngram"


def _chain(steps: int) -> DraftShape:
    return DraftShape(kind="chain", depth=steps, topk=1, nodes=steps)


def _tree(depth: int, topk: int, nodes: int) -> DraftShape:
    most = topk + (depth - 1) * topk * topk  # every candidate EAGLE-2 scores
    if depth < 1 or topk < 1 or not 1 <= nodes <= most:
        raise ValueError(f"need depth ≥ 1, topk ≥ 1 and 1 ≤ nodes ≤ topk + (depth-1)·topk² = {most}")
    return DraftShape(kind="tree", depth=depth, topk=topk, nodes=nodes)


NGRAM_MATCH = 3  # ngram:K looks up the context's last 3, 2, then 1 tokens


def _ngram(steps: int, match: int = NGRAM_MATCH) -> DraftShape:
    if match < 1:
        raise ValueError("need a match length N ≥ 1")
    return DraftShape(kind="ngram", depth=steps, topk=1, nodes=steps, match=match)


def _hybrid(steps: int, match: int = NGRAM_MATCH) -> DraftShape:
    """The drafter's chain, except where the answer is copying its context (on MT-bench's extraction questions
    prompt lookup's τ is well above the drafter's chain's): rows whose last `match` tokens occurred before take prompt
    lookup's continuation instead. Both are drafted every cycle; one verification, as for a chain."""
    if match < 1:
        raise ValueError("need a match length N ≥ 1")
    return DraftShape(kind="hybrid", depth=steps, topk=1, nodes=steps, match=match)


# The one registry of draft shapes: kind → (usage, builder from the integers after the colon).
SHAPES = {
    "chain": ("chain:K", _chain),
    "tree": ("tree:DEPTH,TOPK,NODES", _tree),
    "ngram": ("ngram:K[,N]", _ngram),
    "hybrid": ("hybrid:K[,N]", _hybrid),
}
