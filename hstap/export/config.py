"""ExportConfig: `hstap export --drafter DIR --format sglang|vllm --out DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from hstap.config import Dtype, option


class ExportConfig(BaseModel):
    """Write a trained drafter as a checkpoint SGLang or vLLM loads as an EAGLE-3 draft model."""

    model_config = ConfigDict(extra="forbid")

    drafter: Path = option(help="training run directory (config.json + model.safetensors)")
    format: Literal["sglang", "vllm"] = option(help="the engine that loads it")
    out: Path = option(help="directory to create")
    dtype: Dtype = option("bf16", "floating-point weight dtype")
    with_embedding: bool = option(False, "also write embed_tokens.weight (only SGLang with pipeline parallelism "
                                         "reads it)")
    force: bool = option(False, "replace a non-empty --out")
