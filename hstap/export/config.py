"""ExportConfig: `hstap export --drafter DIR --format sglang|vllm --out DIR` (or `--check` an existing export)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from hstap.config import Dtype, option


class ExportConfig(BaseModel):
    """Write a trained drafter as a checkpoint SGLang or vLLM loads as an EAGLE-3 draft model.

    Every export is re-loaded as the engines read it and checked against the drafter (layer ids, config, every
    tensor, d2t/t2d) before it appears; `--check` runs that check alone on an existing export."""

    model_config = ConfigDict(extra="forbid")

    drafter: Path = option(help="training run directory (config.json + model.safetensors) or a shipped drafter's name "
                                "(reference = smollm2-recipe)")
    format: Literal["sglang", "vllm"] | None = option(None, "the engine that loads it (required unless --check)")
    out: Path = option(help="directory to create (with --check: the export to check)")
    dtype: Dtype = option("bf16", "floating-point weight dtype")
    with_embedding: bool = option(False, "also write embed_tokens.weight (only SGLang with pipeline parallelism "
                                         "reads it)")
    force: bool = option(False, "replace a non-empty --out")
    check: bool = option(False, "write nothing: re-load the export in --out as the engines read it and check it "
                                "against --drafter (layer ids, config, every tensor, d2t/t2d)")
    store: Path | None = option(None, "with --check: also check the export against this capture store (the "
                                      "layers, hidden size and target the serving engine will feed it)")

    @model_validator(mode="after")
    def _format_unless_check(self) -> "ExportConfig":
        if self.format is None and not self.check:
            raise ValueError("--format sglang|vllm is required (unless --check)")
        if self.store is not None and not self.check:
            raise ValueError("--store goes with --check")
        return self
