"""The store's manifest: the single source of truth for what a store contains.

A shard file is part of the store only once `manifest.json` lists it, so readers never see a half-written shard
and a crash between the shard rename and the manifest update leaves an orphan that the next writer removes.

    from hstap.store.manifest import load_manifest
    m = load_manifest("runs/cap/manifest.json")      # Manifest(meta=..., tensors=..., shards=[...], totals=...)
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hstap.config import LEGACY_DTYPES, StoreDtype, TeacherSpec, dtype_name, torch_dtype  # noqa: F401 — re-exported
from hstap.errors import HstapError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class StoreMeta(BaseModel):
    """What was captured; a resumed run must match every field except `extra`."""

    model_config = ConfigDict(extra="forbid")

    model_id: str
    model_fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    hidden_dtype: StoreDtype
    teacher: TeacherSpec
    extra: dict = Field(default_factory=dict)

    @field_validator("hidden_dtype", mode="before")
    @classmethod
    def _short_dtype(cls, value):
        return LEGACY_DTYPES.get(value, value)  # stores written before 2026-12 spell it `bfloat16`


class TensorSpec(BaseModel):
    """On-disk dtype and per-token shape (the shape after dim 0) of one tensor name."""

    model_config = ConfigDict(extra="forbid")

    dtype: str
    shape: list[int]

    @field_validator("dtype", mode="before")
    @classmethod
    def _short_dtype(cls, value):
        return LEGACY_DTYPES.get(value, value)


class SampleEntry(BaseModel):
    """Where one sample's tokens sit inside its shard's concatenated tensors."""

    model_config = ConfigDict(extra="forbid")

    id: str
    offset: int
    length: int


class ShardInfo(BaseModel):
    """One committed shard file, with the checksum `verify_store` recomputes."""

    model_config = ConfigDict(extra="forbid")

    file: str
    sha256: str
    bytes: int
    num_tokens: int
    samples: list[SampleEntry]


class Totals(BaseModel):
    """Sums over all shards, kept so `store_info` needs no walk and `verify_store` can cross-check."""

    model_config = ConfigDict(extra="forbid")

    samples: int = 0
    tokens: int = 0
    bytes: int = 0


class Manifest(BaseModel):
    """The whole store: capture settings, tensor specs, committed shards, totals."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    meta: StoreMeta
    tensors: dict[str, TensorSpec] = Field(default_factory=dict)
    shards: list[ShardInfo] = Field(default_factory=list)
    totals: Totals = Field(default_factory=Totals)
    created: str
    updated: str


def now_iso() -> str:
    """UTC timestamp to the second, the format manifests use."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable: without this a power loss can undo an `os.replace`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path.tmp`, fsync, rename over `path`, fsync the directory: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_manifest(path: Path | str, manifest: Manifest) -> None:
    """Atomically replace the manifest at `path` (compact JSON: it is rewritten at every shard commit)."""
    atomic_write(Path(path), manifest.model_dump_json().encode())


def load_manifest(path: Path | str) -> Manifest:
    """Read and validate a manifest.

    Raises:
        HstapError: invalid JSON, a schema_version this code does not read, or a missing/ill-typed field;
            the one-line message names the file and the field.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HstapError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise HstapError(f"{path}: expected a JSON object, found {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise HstapError(
            f"{path}: schema_version={version!r}, this hstap reads {SCHEMA_VERSION}: "
            "upgrade hstap or re-capture into a new directory"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise HstapError(f"{path}: field {field}: {err['msg']}") from e
