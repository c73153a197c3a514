"""Configs of the store commands: `hstap store info|verify DIR` and `hstap compare DIR_A DIR_B`."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from hstap.config import option


class StoreInfoConfig(BaseModel):
    """Samples, tokens, layers, dtype, bytes/token and bytes on disk of a store; exit 1 naming a missing or
    truncated shard, totals that disagree with the shards, or an unlisted shard file (no checksums: `verify`)."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = option(help="the store directory", positional=True)
    as_json: bool = option(False, "machine-readable output", flag="--json")


class StoreVerifyConfig(BaseModel):
    """Check every shard's checksum; exit 1 naming a bad shard (or a shard file the manifest does not list)."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = option(help="the store directory", positional=True)


class CompareConfig(BaseModel):
    """Per-layer, per-sample differences between two stores of the same samples; exit 0 MATCH, 1 MISMATCH, 3 when
    every common sample matches but a store has samples the other lacks.

    A tensor stored in a low-precision dtype may differ by its own rounding step whatever `rtol` asks (see
    `hstap.config.rounding_step`); fp32 tensors keep `rtol` itself."""

    model_config = ConfigDict(extra="forbid")

    dir_a: Path = option(help="the first store", positional=True)
    dir_b: Path = option(help="the second store (the reference of the relative error)", positional=True)
    rtol: float = option(1e-2, "largest relative error ||a-b||/||b|| still a match", gt=0)
    min_cos: float = option(0.999, "lowest per-token cosine similarity still a match", gt=-1, le=1)
    per_sample: bool = option(False, "print every sample's numbers too")
    as_json: bool = option(False, "machine-readable output", flag="--json")
