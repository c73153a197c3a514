"""Configs of the store commands: `hstap store info|verify DIR`, `hstap store merge --out DIR A B ...` and
`hstap compare DIR_A DIR_B`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from hstap.config import option


PROJECT_SAMPLES = (10_000, 100_000, 1_000_000)  # store sizes `hstap store info` projects by default
HIDDEN_DTYPE = "bf16"  # how captured hidden states are stored unless a --dtype says otherwise (every capture path)
SHARD_MB = 256  # buffered MiB a store commits as one shard: StoreWriter's default, `hstap capture --shard-mb`'s
# `hstap compare`'s match bounds, also the defaults of hstap.store.compare.compare_stores (tests call it directly)
MATCH_RTOL = 1e-2
MATCH_MIN_COS = 0.999
REFERENCE_WITHIN = 2.0


class StoreInfoConfig(BaseModel):
    """Samples, tokens, layers, dtype, bytes/token, bytes on disk and projected sizes of a store; exit 1 naming a
    missing or truncated shard, totals that disagree with the shards, or an unlisted shard file (no checksums:
    `verify`)."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = option(help="the store directory", positional=True)
    project: list[Annotated[int, Field(gt=0)]] = option(
        default_factory=lambda: list(PROJECT_SAMPLES),
        help="print the size of a store of N samples like these (repeatable)", metavar="N")
    as_json: bool = option(False, "machine-readable output", flag="--json")


class StoreVerifyConfig(BaseModel):
    """Check every shard's checksum; exit 1 naming a bad shard (or a shard file the manifest does not list)."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = option(help="the store directory", positional=True)


class StoreMergeConfig(BaseModel):
    """One store from several (each node's capture): shards hard-linked (or copied, checked) under new numbers,
    one manifest written last; a merge killed on the way is finished by the same command."""

    model_config = ConfigDict(extra="forbid")

    stores: list[Path] = option(help="the stores to merge (two or more), in the order their samples are kept",
                                positional=True, several=True)
    out: Path = option(help="the merged store's directory (new, or an interrupted merge of the same stores)")
    copy_shards: bool = option(False, "copy every shard even where a hard link would do (OUT then shares no file "
                                      "with the inputs)", flag="--copy")


class CompareConfig(BaseModel):
    """Per-layer, per-sample differences between two stores of the same samples; exit 0 MATCH, 1 MISMATCH, 3 when
    every common sample matches but a store has samples the other lacks.

    A tensor stored in a low-precision dtype may differ by its own rounding step whatever `rtol` asks, and its
    per-token cosine may fall to 1 - step**2/2 whatever `min_cos` asks (see `hstap.config.rounding_step`; fp8:
    0.125 and 0.992); fp32 tensors keep `rtol` and `min_cos` themselves."""

    model_config = ConfigDict(extra="forbid")

    dir_a: Path = option(help="the first store", positional=True)
    dir_b: Path = option(help="the second store (the reference of the relative error)", positional=True)
    rtol: float = option(MATCH_RTOL, "largest relative error ||a-b||/||b|| still a match", gt=0)
    min_cos: float = option(MATCH_MIN_COS, "lowest per-token cosine similarity still a match", gt=-1, le=1)
    reference: Path | None = option(None, "a capture of the same samples in a finer dtype (`hstap capture "
                                          "--target-dtype fp32`): judge A and B each against it, not one "
                                          "against the other")
    within: float = option(REFERENCE_WITHIN, "with --reference: how many times the other store's error against it "
                                             "a store's may be", ge=1)
    any_model: bool = option(False, "compare stores whose model fingerprints differ (the same weights under another "
                                    "config.json, e.g. an engine's wrapper of the checkpoint)")
    per_sample: bool = option(False, "print every sample's numbers too")
    as_json: bool = option(False, "machine-readable output", flag="--json")
