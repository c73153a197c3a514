"""EvalConfig: what `hstap eval` measures; `--plan` prints it resolved."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from hstap.config import option
from hstap.errors import HstapError

DEFAULT_SHAPES = ["chain:3"]


class EvalConfig(BaseModel):
    """Speculative decoding with the embedded target against vanilla decoding, in one run."""

    model_config = ConfigDict(extra="forbid")

    model: str = option("smollm2", "the target: 'smollm2' or a checkpoint dir")
    drafter: Path = option(help="drafter run directory (written by `hstap train`)")
    bench: str = option("mt-bench", "mt-bench | sharegpt | jsonl:PATH (first user turn each)")
    limit: int | None = option(None, "first N prompts", ge=1)
    chain: list[int] = option(default_factory=list, help="chain draft of K tokens (repeatable; chain 3 when no "
                                                         "shape is given)", metavar="K")
    tree: list[str] = option(default_factory=list, help="EAGLE-2 dynamic tree: depth, top-k per node, draft "
                                                        "tokens (repeatable)", metavar="D,TOPK,N")
    temperature: float = option(0.0, "0 = greedy; > 0 = speculative sampling", ge=0)
    max_new_tokens: int = option(128, "longest answer per prompt", ge=2)
    warmup: int = option(1, "untimed runs of each method on the first prompt", ge=0)
    seed: int = option(0, "sampling seed (per prompt)")
    device: str = option("cpu", "cpu | cuda | cuda:N")
    out: Path | None = option(None, "report directory (default: the drafter's)")
    as_json: bool = option(False, "print report.json to stdout instead of a summary", flag="--json")

    @model_validator(mode="after")
    def _known_shapes(self) -> "EvalConfig":
        from hstap.evaluate.shapes import DraftShape

        for spec in self.shapes:
            try:
                DraftShape.parse(spec)
            except HstapError as exc:
                raise ValueError(str(exc)) from None
        return self

    @property
    def shapes(self) -> list[str]:
        """Every draft shape, as `chain:K` / `tree:D,TOPK,N` specs."""
        specs = [f"chain:{k}" for k in self.chain] + [f"tree:{t}" for t in self.tree]
        return specs or list(DEFAULT_SHAPES)

    def resolved(self) -> dict:
        return {**self.model_dump(mode="json"), "shapes": self.shapes}


def shape_fields(specs: list[str]) -> dict[str, list]:
    """`["chain:3", "tree:8,8,60"]` → `{"chain": [3], "tree": ["8,8,60"]}`: EvalConfig's fields for these shapes."""
    fields: dict[str, list] = {"chain": [], "tree": []}
    for spec in specs:
        kind, _, args = spec.partition(":")
        if kind not in fields:
            raise HstapError(f"draft shape {spec!r}: expected chain:K or tree:DEPTH,TOPK,NODES")
        fields[kind].append(int(args) if kind == "chain" and args.isdigit() else args)
    return fields
