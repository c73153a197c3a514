"""EvalConfig: what `hstap eval` measures; `--plan` prints it resolved."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from hstap.config import Device, Dtype, option
from hstap.errors import HstapError

DEFAULT_SHAPES = ["ngram:3", "chain:3"]


class EvalConfig(BaseModel):
    """Speculative decoding with the embedded target against vanilla decoding, in one run."""

    model_config = ConfigDict(extra="forbid")

    model: str = option("smollm2", "the target: 'smollm2' or a checkpoint dir")
    drafter: Path | None = option(None, "drafter run directory (written by `hstap train`) or a shipped drafter's "
                                        "name (reference = smollm2-recipe); needed by chain and tree shapes")
    bench: str = option("mt-bench", "mt-bench | sharegpt | jsonl:PATH (first user turn each)")
    limit: int | None = option(None, "first N prompts", ge=1)
    ngram: list[int] = option(default_factory=list, help="prompt lookup (n-gram) draft of K tokens, no drafter "
                                                         "(repeatable; ngram:K[,N] as --set shapes)", metavar="K")
    chain: list[int] = option(default_factory=list, help="chain draft of K tokens (repeatable; ngram 3 and chain "
                                                         "3 when no shape is given)", metavar="K")
    tree: list[str] = option(default_factory=list, help="EAGLE-2 dynamic tree: depth, top-k per node, draft "
                                                        "tokens (repeatable)", metavar="D,TOPK,N")
    hybrid: list[str] = option(default_factory=list, help="chain draft of K tokens, replaced by prompt lookup in "
                                                          "rows whose last N tokens (default 3) occurred before "
                                                          "(repeatable)", metavar="K[,N]")
    temperature: float = option(0.0, "0 = greedy; > 0 = speculative sampling", ge=0)
    max_new_tokens: int = option(128, "longest answer per prompt", ge=2)
    batch: int = option(1, "prompts decoded together (every method, vanilla too)", ge=1)
    warmup: int = option(1, "untimed runs of each method on the first batch", ge=0)
    seed: int = option(0, "sampling seed (per batch)")
    device: Device = option("cpu", "cpu | cuda | cuda:N")
    dtype: Dtype | None = option(None, "target and drafter dtype (default: fp32 on CPU, bf16 on CUDA)")
    cuda_graphs: bool = option(True, "on CUDA, replay captured graphs (--no-cuda-graphs: the same code eagerly)")
    out: Path | None = option(None, "report directory (default: the drafter's)")
    as_json: bool = option(False, "print report.json to stdout instead of a summary", flag="--json")

    @model_validator(mode="after")
    def _known_shapes(self) -> "EvalConfig":
        from hstap.runtime.shapes import DraftShape

        for spec in self.shapes:
            try:
                shape = DraftShape.parse(spec)
            except HstapError as exc:
                raise ValueError(str(exc)) from None
            if shape.uses_drafter and self.drafter is None:
                raise ValueError(f"draft shape {spec} needs --drafter (only ngram:K runs without one)")
        if self.drafter is None and self.out is None:
            raise ValueError("without --drafter, give --out for the report")
        return self

    @property
    def shapes(self) -> list[str]:
        """Every draft shape, as `chain:K` / `tree:D,TOPK,N` specs."""
        specs = [f"ngram:{k}" for k in self.ngram] + [f"chain:{k}" for k in self.chain] + \
            [f"tree:{t}" for t in self.tree] + [f"hybrid:{k}" for k in self.hybrid]
        return specs or list(DEFAULT_SHAPES)

    def resolved(self) -> dict:
        return {**self.model_dump(mode="json"), "shapes": self.shapes}


def shape_fields(specs: list[str]) -> dict[str, list]:
    """`["ngram:3", "chain:3", "tree:8,8,60"]` → `{"ngram": [3], "chain": [3], "tree": ["8,8,60"], "hybrid": []}`:
    EvalConfig's fields for these shapes."""
    fields: dict[str, list] = {"ngram": [], "chain": [], "tree": [], "hybrid": []}
    for spec in specs:
        kind, _, args = spec.partition(":")
        if kind not in fields:
            raise HstapError(f"draft shape {spec!r}: expected ngram:K, chain:K, hybrid:K or tree:DEPTH,TOPK,NODES")
        fields[kind].append(int(args) if kind in ("ngram", "chain") and args.isdigit() else args)
    return fields
