"""The store's manifest: the single source of truth for what a store contains.

A shard file is part of the store only once `manifest.json` lists it, so readers never see a half-written shard
and a crash between the shard rename and the manifest update leaves an orphan that the next writer removes.

    from hstap.store.manifest import load_manifest
    m = load_manifest("runs/cap/manifest.json")      # Manifest(meta=..., tensors=..., shards=[...], totals=...)
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hstap.config import LEGACY_DTYPES, StoreDtype, TeacherSpec, dtype_name, torch_dtype  # noqa: F401 — re-exported
from hstap.errors import HstapError
from hstap.faults import fault_point

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_files(path: Path) -> list[Path]:
    """The `shard-NNNNN.safetensors` files in `path`, by index (listed in the manifest or not)."""
    found = [f for f in path.iterdir() if SHARD_RE.match(f.name) and f.is_file()] if path.is_dir() else []
    return sorted(found, key=lambda f: int(SHARD_RE.match(f.name).group(1)))


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

    @classmethod
    def of(cls, shards: list[ShardInfo]) -> Totals:
        """The totals a list of shards adds up to (a rebuilt or repaired manifest, a check of the stored ones)."""
        return cls(samples=sum(len(s.samples) for s in shards), tokens=sum(s.num_tokens for s in shards),
                   bytes=sum(s.bytes for s in shards))


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


def atomic_write(path: Path, data: bytes, fault: str = "") -> None:
    """Write `path.tmp`, fsync, rename over `path`, fsync the directory: readers see old or new, never half.

    A failed write (a full disk) removes its `.tmp` before the error propagates, so it leaves no space taken.
    `fault`: the HSTAP_FAULT point passed with half of `data` written (crash and disk-full tests)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            if fault:
                fault_point(fault)
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_manifest(path: Path | str, manifest: Manifest) -> None:
    """Atomically replace the manifest at `path` (compact JSON: it is rewritten at every shard commit)."""
    atomic_write(Path(path), manifest.model_dump_json().encode(), fault="manifest-write")


def load_manifest(path: Path | str) -> Manifest:
    """Read and validate a manifest.

    Raises:
        HstapError: invalid JSON, a schema_version this code does not read, or a missing/ill-typed field;
            the one-line message names the file and the field.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise HstapError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:
        raise HstapError(f"{path}: not JSON text (byte {e.start} is not UTF-8)") from e
    except OSError as e:
        raise HstapError(f"{path}: cannot read ({e.strerror})") from e
    if not isinstance(data, dict):
        raise HstapError(f"{path}: expected a JSON object, found {type(data).__name__}")
    version = data.get("schema_version")
    missing = [k for k in Manifest.model_fields if k not in data]
    if missing and version == SCHEMA_VERSION:  # the writer writes every field: a default would hide a lost list
        raise HstapError(f"{path}: field {missing[0]}: missing")
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
