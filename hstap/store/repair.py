"""What a writer does with a store that is not as its manifest says, before it appends anything.

    manifest = rebuild_manifest(Path("runs/cap"), meta)     # manifest.json lost: read the shard headers back
    manifest = adopt(manifest, path / "shard-00007.safetensors")   # renamed by a commit that was killed
    manifest, notes = set_aside(path, manifest, {"shard-00003.safetensors": "missing"})   # --repair

Nothing here deletes a shard that holds committed samples: `.tmp` files and an interrupted commit's shard that
cannot be adopted are the only files removed (neither was ever listed); any other unlisted shard is refused.

Every shard carries its sample ids (`samples`: [[id, offset, length], ...]) and, since 2026-12, the capture
settings (`meta`) in its safetensors header, so a store whose manifest was deleted is rebuilt from its shards,
never deleted. What a rebuild cannot recover is each shard's commit-time checksum: it is recomputed from the bytes
found, so a shard damaged while the manifest was gone is adopted as it is (verify cannot tell).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError
from safetensors import safe_open

from hstap.config import dtype_name
from hstap.errors import HstapError
from hstap.store.manifest import (
    MANIFEST_NAME,
    SHARD_RE,
    Manifest,
    SampleEntry,
    ShardInfo,
    StoreMeta,
    TensorSpec,
    Totals,
    now_iso,
    shard_files,
    shard_name,
)
from hstap.store.reader import sha256_file

DAMAGED_SUFFIX = ".damaged"


def _read_header(file: Path) -> tuple[StoreMeta, list[SampleEntry], dict[str, TensorSpec], int]:
    """(meta, samples, tensor specs, tokens) from one shard's header.

    Raises:
        ValueError: what makes the shard unusable, worded to follow its name.
    """
    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            names = list(f.keys())
            shapes = {n: f.get_slice(n).get_shape() for n in names}
            dtypes = {n: dtype_name(f.get_slice(n)[0:1].dtype) for n in names}
    except Exception as exc:  # noqa: BLE001 — SafetensorError for a damaged header
        raise ValueError(f"is not a readable shard ({exc})") from None
    if "meta" not in header or "samples" not in header:
        raise ValueError("was written before shards carried their capture settings, so it cannot be checked "
                         "against this run")
    try:
        meta = StoreMeta.model_validate_json(header["meta"])
        samples = [SampleEntry(id=str(i), offset=int(o), length=int(n)) for i, o, n in json.loads(header["samples"])]
    except (ValidationError, ValueError, TypeError) as exc:
        raise ValueError(f"has an unreadable header ({str(exc).splitlines()[0]})") from None
    tokens = {shape[0] for shape in shapes.values()}
    if len(tokens) != 1 or sum(e.length for e in samples) != next(iter(tokens)):
        raise ValueError(f"is not a whole shard (tensors of {sorted(tokens)} rows, samples of "
                         f"{sum(e.length for e in samples)} tokens)")
    specs = {n: TensorSpec(dtype=dtypes[n], shape=shapes[n][1:]) for n in names}
    return meta, samples, specs, next(iter(tokens))


def _diffs(stored: StoreMeta, asked: StoreMeta) -> list[str]:
    old, new = stored.model_dump(exclude={"extra"}), asked.model_dump(exclude={"extra"})
    return [f"{k}={old[k]}, this run asks {new[k]}" for k in old if old[k] != new[k]]


def _shard_info(file: Path, samples: list[SampleEntry], tokens: int) -> ShardInfo:
    return ShardInfo(file=file.name, sha256=sha256_file(file), bytes=file.stat().st_size, num_tokens=tokens,
                     samples=samples)


def rebuild_manifest(path: Path, asked: StoreMeta) -> Manifest | None:
    """The manifest of `path` rebuilt from its shard headers (None when it holds no shard file).

    Raises:
        HstapError: a shard that cannot be read or predates the meta header, settings other than `asked`
            (`extra` aside), tensors that differ between shards, or a sample id in two shards; named.
    """
    files = shard_files(path)
    if not files:
        return None
    shards: list[ShardInfo] = []
    tensors: dict[str, TensorSpec] | None = None
    seen: dict[str, str] = {}
    lost = f"{path} has no {MANIFEST_NAME} and"
    for file in files:
        try:
            meta, samples, specs, tokens = _read_header(file)
        except ValueError as exc:
            raise HstapError(f"{lost} {file.name} {exc}: restore the manifest, or move the shard away and "
                             "re-run") from None
        if diffs := _diffs(meta, asked):
            raise HstapError(f"{lost} {file.name} was captured with {'; '.join(diffs)}: use another --out or the "
                             "same settings")
        if tensors is not None and specs != tensors:
            raise HstapError(f"{lost} {file.name} holds other tensors than {files[0].name}: move the odd shard "
                             "away and re-run")
        tensors = specs
        for e in samples:
            if e.id in seen:
                raise HstapError(f"{lost} sample {e.id!r} is in both {seen[e.id]} and {file.name}: move one away "
                                 "and re-run")
            seen[e.id] = file.name
        shards.append(_shard_info(file, samples, tokens))
    now = now_iso()
    return Manifest(meta=asked, tensors=tensors or {}, shards=shards, totals=Totals.of(shards), created=now,
                    updated=now)


def adopt(manifest: Manifest, file: Path) -> Manifest | None:
    """`manifest` with `file` appended: the shard an interrupted commit renamed into place but never listed. It
    was fsynced whole before the rename, so its samples are kept rather than captured again — if its header is
    readable, of this store's settings and tensors, and names no listed sample. None otherwise."""
    try:
        meta, samples, specs, tokens = _read_header(file)
    except ValueError:
        return None
    listed = {e.id for s in manifest.shards for e in s.samples}
    ids = [e.id for e in samples]
    if (_diffs(meta, manifest.meta) or (manifest.tensors and specs != manifest.tensors)
            or len(set(ids)) != len(ids) or listed.intersection(ids)):
        return None
    shards = [*manifest.shards, _shard_info(file, samples, tokens)]
    return manifest.model_copy(update={"shards": shards, "tensors": manifest.tensors or specs,
                                       "totals": Totals.of(shards), "updated": now_iso()})


def set_aside(path: Path, manifest: Manifest, damaged: dict[str, str]) -> tuple[Manifest, list[str]]:
    """Drop the `damaged` shards (file → problem) from the manifest and rename their files `*.damaged` (kept, out
    of the store's way, never deleted), so their samples count as not captured; returns the new manifest and one
    note each. The caller saves the manifest: a crash before that leaves a manifest naming a missing file, which
    the next `--repair` sets aside the same way."""
    notes = []
    for shard in manifest.shards:
        if shard.file not in damaged:
            continue
        file = path / shard.file
        if file.exists():
            aside, n = file.with_name(file.name + DAMAGED_SUFFIX), 1
            while aside.exists():  # set aside before, under the same name: keep both
                aside, n = file.with_name(f"{file.name}{DAMAGED_SUFFIX}.{n}"), n + 1
            file.rename(aside)
        notes.append(f"set aside {shard.file} ({damaged[shard.file]}): its {len(shard.samples)} samples are "
                     "captured again")
    kept = [s for s in manifest.shards if s.file not in damaged]
    return manifest.model_copy(update={"shards": kept, "totals": Totals.of(kept), "updated": now_iso()}), notes


def remove_tmp(path: Path) -> list[str]:
    """Delete the store's `.tmp` files (never part of it: a write that did not finish); return their names."""
    removed = []
    for f in sorted(path.iterdir()):
        ours = f.name.startswith("shard-") or f.name == MANIFEST_NAME + ".tmp"
        if f.is_file() and f.name.endswith(".tmp") and ours:
            f.unlink()
            removed.append(f.name)
    return removed


def interrupted_commit(path: Path, manifest: Manifest) -> Path | None:
    """The shard after the last listed one, if an interrupted commit left it; any other unlisted shard is refused:
    no commit of this manifest leaves it (an older manifest restored over newer shards, a file copied in)."""
    listed = {s.file for s in manifest.shards}
    last = max((int(m.group(1)) for f in listed if (m := SHARD_RE.match(f))), default=-1)
    after_last = shard_name(last + 1)
    found = None
    for f in shard_files(path):
        if f.name in listed:
            continue
        if f.name != after_last:
            raise HstapError(f"store {path}: {f.name} is on disk but not listed in {MANIFEST_NAME}, and no "
                             f"interrupted commit leaves that file (it would be {after_last}): move it away, or "
                             "restore the manifest that lists it, then re-run")
        found = f
    return found
