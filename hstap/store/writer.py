"""Append captured samples to a store: buffered, sharded, atomic, resumable.

    from hstap.store import StoreMeta, StoreWriter
    with StoreWriter("runs/cap", meta, shard_bytes=256 << 20) as w:
        for sid, tensors in samples:
            if sid not in w.committed_ids:
                w.add(sid, tensors)     # {"input_ids": [S], "loss_mask": [S], "hidden.14": [S, H], ...}

Commit order (the crash-safety argument): shard bytes -> `shard-NNNNN.safetensors.tmp` -> fsync -> rename ->
fsync dir -> manifest (same dance). Until the manifest lists a shard it is not part of the store. On reopen the
writer deletes leftover `.tmp` files, adopts the one unlisted shard an interrupted commit can leave (the shard after
the last listed one, whole since it was fsynced before the rename; deleted instead if its header does not fit this
store), reports both in `cleaned`/`notes`, and refuses any other unlisted shard rather than delete it.

A shard commits when `shard_bytes` are buffered (checked at each `add`), and when the caller's `commit_if_due()`
finds `commit_every_s` passed since the last commit (or the opening). Capture calls it once a whole batch is in
(hstap.capture.stop.GuardedSink, from the tap's writer thread), so a batch completed after the interval is committed
at once, whole, not a batch late: a kill loses at most `commit_every_s` of completed work (plus the batch in flight). On reopen every listed shard must be present with its recorded size, or the writer
refuses, naming it (`repair=True`: full checksums, damaged shards renamed `*.damaged` and their samples
captured again). A directory whose manifest is gone is rebuilt from the shard headers (hstap.store.repair). A store
that holds no shard at all (a run that failed before its first commit) takes the settings of the next run instead of
refusing them: nothing was kept that they could contradict.
A commit that fails (a full disk) removes its partial file and raises `StoreWriteError`; the buffer is kept.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Callable

import torch
from safetensors.torch import save as st_save

from hstap.errors import HstapError
from hstap.faults import fault_point
from hstap.store.config import SHARD_MB
from hstap.store.estimate import bytes_per_token, human_bytes
from hstap.store.manifest import (
    MANIFEST_NAME,
    SHARD_RE,
    Manifest,
    SampleEntry,
    ShardInfo,
    StoreMeta,
    TensorSpec,
    Totals,
    atomic_write,
    dtype_name,
    load_manifest,
    now_iso,
    save_manifest,
    shard_files,
    shard_name,
    torch_dtype,
)
from hstap.store.names import hidden_layer, scale_name
from hstap.store.reader import _shard_problems, listed_problem
from hstap.store.repair import adopt, interrupted_commit, rebuild_manifest, remove_tmp, set_aside

LOCK_NAME = ".writer.lock"
INT32 = torch.iinfo(torch.int32)


class StoreWriteError(HstapError):
    """A commit's write failed (a full disk, an I/O error): the partial file is gone, committed shards are intact."""


class StoreWriter:
    """Buffers samples and commits one safetensors shard each time `shard_bytes` are buffered.

    Attributes:
        committed_ids: ids already in the store (resume: skip these); grows as shards commit.
        cleaned: files removed on open (an interrupted commit's shard, leftover `.tmp`), for the caller to report.
        notes: what else opening did (a manifest rebuilt from shard headers, damaged shards set aside), one line each.
    """

    def __init__(self, path: Path | str, meta: StoreMeta, shard_bytes: int = SHARD_MB << 20,
                 commit_every_s: float | None = None, repair: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.meta = meta
        self.shard_bytes = shard_bytes
        self.commit_every_s = commit_every_s
        self._clock = clock
        self.notes: list[str] = []
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HstapError(f"store {self.path}: cannot create the directory ({e.strerror}): expected a writable "
                             "directory path") from None
        self._lock_fd = _lock(self.path)
        try:
            self.manifest = self._open_manifest()
            self.manifest, self.cleaned = self._tidy(self.manifest)
            self.manifest = self._check_listed(self.manifest, repair)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.committed_ids: set[str] = {e.id for s in self.manifest.shards for e in s.samples}
        indices = [int(SHARD_RE.match(s.file).group(1)) for s in self.manifest.shards if SHARD_RE.match(s.file)]
        self._next_index = max(indices, default=-1) + 1
        # One growable (capacity, *shape) buffer per tensor name, reused across shards: add() copies each sample
        # straight into it, so a shard costs one copy in (no per-sample clone, no torch.cat) and, after the first
        # shard, no fresh pages (page faults dominated the write time on a busy 2-core VM).
        self._bufs: dict[str, torch.Tensor] = {}
        self._rows = 0  # tokens buffered
        self._entries: list[SampleEntry] = []
        self._buffered_ids: set[str] = set()
        self._last_commit = clock()  # commit_if_due() measures from here: the opening, then each commit

    def _open_manifest(self) -> Manifest:
        file = self.path / MANIFEST_NAME
        if not file.exists():
            rebuilt = rebuild_manifest(self.path, self.meta)
            if rebuilt is not None:
                self.notes.append(f"rebuilt {MANIFEST_NAME} from the headers of {len(rebuilt.shards)} shards "
                                  f"({rebuilt.totals.samples} samples)")
            # Written now, not at first commit: a store with nothing committed still opens and reports 0 samples.
            manifest = rebuilt or Manifest(meta=self.meta, created=now_iso(), updated=now_iso())
            self._save(manifest, MANIFEST_NAME)
            return manifest
        manifest = load_manifest(file)
        if manifest.meta != self.meta and not manifest.shards and not shard_files(self.path):
            # nothing committed, no shard on disk: the settings of a run that failed before its first commit pin
            # nothing (e.g. `--teacher topk:100000`); the corrected command writes its own
            old = _meta_diffs(manifest.meta, self.meta)
            manifest = Manifest(meta=self.meta, created=manifest.created, updated=now_iso())
            self._save(manifest, MANIFEST_NAME)
            if old:
                self.notes.append(f"the store held no sample: its settings were replaced ({'; '.join(old)})")
            return manifest
        _check_same_meta(self.path, manifest.meta, self.meta)
        return manifest

    def _tidy(self, manifest: Manifest) -> tuple[Manifest, list[str]]:
        """Remove `.tmp` leftovers; adopt the shard an interrupted commit left (or remove it, when its header
        does not fit: it holds no committed sample); refuse any other unlisted shard rather than delete it."""
        removed = remove_tmp(self.path)
        after_last = interrupted_commit(self.path, manifest)
        if after_last is not None:
            adopted = adopt(manifest, after_last)
            if adopted is None:
                after_last.unlink()
                removed.append(after_last.name)
            else:
                self._save(adopted, MANIFEST_NAME)
                self.notes.append(f"kept {after_last.name}, which an interrupted commit left unlisted "
                                  f"({len(adopted.shards[-1].samples)} samples)")
                manifest = adopted
        return manifest, removed

    def _check_listed(self, manifest: Manifest, repair: bool) -> Manifest:
        """Every listed shard present with its recorded size (one stat each), else refuse naming it; `repair`:
        full checksums, and damaged shards set aside so their samples are captured again."""
        if repair:
            damaged = {s.file: p[0] for s in manifest.shards if (p := _shard_problems(self.path, s, manifest))}
        else:
            damaged = {s.file: p for s in manifest.shards if (p := listed_problem(self.path, s))}
        if not damaged:
            return manifest
        if not repair:
            first = next(iter(damaged.values()))
            more = f" (+{len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise HstapError(f"store {self.path} cannot be resumed: {first}{more}; restore the file, or re-run with "
                             "--repair to set damaged shards aside and capture their samples again")
        manifest, notes = set_aside(self.path, manifest, damaged)
        self._save(manifest, MANIFEST_NAME)
        self.notes += notes
        return manifest

    def add(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Validate and buffer one sample; commits a shard once the buffer reaches `shard_bytes`.

        The tensors are copied into the writer's buffers, so callers may reuse theirs (capture's pinned
        buffers) right after `add` returns.
        `input_ids` of any integer dtype are stored as int32 (the reader hands back int64).

        Raises:
            HstapError: duplicate id, a different key set, dtype or per-token shape than earlier samples,
                or unequal dim 0; the message names the sample id and the tensor.
        """
        if sample_id in self.committed_ids or sample_id in self._buffered_ids:
            raise HstapError(f"sample {sample_id!r} is already in the store {self.path}: ids must be unique")
        prepared = {name: _prepare(sample_id, name, t) for name, t in tensors.items()}
        _check_lengths(sample_id, prepared)
        if not self.manifest.tensors:
            specs = {n: TensorSpec(dtype=dtype_name(t.dtype), shape=list(t.shape[1:])) for n, t in prepared.items()}
            _check_hidden_against_meta(sample_id, specs, self.meta)
            self.manifest = self.manifest.model_copy(update={"tensors": specs})
        _check_against_specs(sample_id, prepared, self.manifest.tensors)
        length = int(next(iter(prepared.values())).shape[0])
        self._reserve(self._rows + length)
        for name, t in prepared.items():
            self._bufs[name][self._rows : self._rows + length].copy_(t)  # (S, *shape), from any device
        self._entries.append(SampleEntry(id=sample_id, offset=self._rows, length=length))
        self._buffered_ids.add(sample_id)
        self._rows += length
        fault_point("sample-buffered")
        if self._rows * bytes_per_token(self.manifest.tensors) >= self.shard_bytes:
            self._commit()

    def commit_if_due(self) -> bool:
        """Commit what is buffered if `commit_every_s` has passed since the last commit (or the opening); call it
        when a unit of work is whole (capture: a batch, all its samples added), so everything completed by then
        is kept. Returns whether it committed."""
        if self.commit_every_s is None or not self._entries:
            return False
        if self._clock() - self._last_commit < self.commit_every_s:
            return False
        self._commit()
        return True

    def _reserve(self, rows: int) -> None:
        """Grow the buffers to hold `rows` tokens: first to about one shard, then by doubling."""
        specs = self.manifest.tensors
        cap = len(next(iter(self._bufs.values()))) if self._bufs else 0
        if rows <= cap:
            return
        new_cap = max(rows, 2 * cap, self.shard_bytes // max(bytes_per_token(specs), 1) + 1)
        for name, spec in specs.items():
            buf = torch.empty((new_cap, *spec.shape), dtype=torch_dtype(spec.dtype))
            if name in self._bufs:
                buf[: self._rows] = self._bufs[name][: self._rows]
            self._bufs[name] = buf

    def flush(self) -> None:
        """Commit whatever is buffered as one (possibly small) shard."""
        if self._entries:
            self._commit()

    def discard(self) -> None:
        """Drop what is buffered, uncommitted (after a failed commit: a resume captures those samples again)."""
        self._entries, self._buffered_ids, self._rows = [], set(), 0

    def close(self) -> None:
        """Flush and release the writer lock."""
        if self._lock_fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1
            self._bufs = {}

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _commit(self) -> None:
        entries, offset = self._entries, self._rows
        joined = {n: b[:offset] for n, b in self._bufs.items()}  # each (N_tokens, *shape), contiguous views
        # Sample ids and capture settings in the header too: if the manifest is ever lost, the shards rebuild it.
        header = {"hstap_schema_version": "1", "samples": json.dumps([[e.id, e.offset, e.length] for e in entries]),
                  "meta": self.meta.model_dump_json()}
        data = st_save(joined, metadata=header)
        del joined
        digest = hashlib.sha256(data).hexdigest()
        file = shard_name(self._next_index)
        try:
            atomic_write(self.path / file, data, fault="shard-write")
        except OSError as exc:
            raise self._write_error(exc, file, len(data)) from None
        fault_point("shard-renamed")
        shard = ShardInfo(file=file, sha256=digest, bytes=len(data), num_tokens=offset, samples=entries)
        old = self.manifest
        t = old.totals
        totals = Totals(samples=t.samples + len(entries), tokens=t.tokens + offset, bytes=t.bytes + len(data))
        manifest = old.model_copy(update={"shards": [*old.shards, shard], "totals": totals, "updated": now_iso()})
        self._save(manifest, file)
        # Only now is the shard part of the store; update in-memory state after the manifest is durable.
        self.manifest = manifest
        self._next_index += 1
        self.committed_ids |= self._buffered_ids
        self._entries, self._buffered_ids, self._rows = [], set(), 0
        self._last_commit = self._clock()
        fault_point("shard-committed")

    def _save(self, manifest: Manifest, shard: str) -> None:
        """Write the manifest; if that fails before it names `shard`, remove the shard so no space stays taken."""
        try:
            save_manifest(self.path / MANIFEST_NAME, manifest)
        except OSError as exc:
            if SHARD_RE.match(shard) and not _lists(self.path, shard):
                (self.path / shard).unlink(missing_ok=True)
            raise self._write_error(exc, MANIFEST_NAME, len(manifest.model_dump_json())) from None

    def _write_error(self, exc: OSError, what: str, size: int) -> StoreWriteError:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free space" if full else "make the disk writable"
        return StoreWriteError(f"store {self.path}: {exc.strerror or exc} writing {what} ({human_bytes(size)}); "
                               f"the partial file was removed and the store keeps its {self.manifest.totals.samples} "
                               f"committed samples: {fix} and re-run the same command to resume")


def _lists(path: Path, shard: str) -> bool:
    """Whether the manifest on disk names `shard` (True when it cannot be read: then keep the shard)."""
    try:
        return any(s.file == shard for s in load_manifest(path / MANIFEST_NAME).shards)
    except HstapError:
        return True


def _lock(path: Path) -> int:
    # Two writers appending to one store would both pick the same next shard index and clobber each other.
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise HstapError(f"store {path}: cannot create {LOCK_NAME} ({e.strerror}): expected a writable "
                         "directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HstapError(f"another writer holds {path}: wait for it to finish or use another --out") from None
    return fd


def _meta_diffs(stored: StoreMeta, asked: StoreMeta) -> list[str]:
    """`field=stored, this run asks asked` for every field but `extra` that differs."""
    old, new = stored.model_dump(exclude={"extra"}), asked.model_dump(exclude={"extra"})
    return [f"{k}={old[k]}, this run asks {new[k]}" for k in old if old[k] != new[k]]


def _check_same_meta(path: Path, stored: StoreMeta, asked: StoreMeta) -> None:
    diffs = _meta_diffs(stored, asked)
    if diffs:
        raise HstapError(
            f"store {path} was captured with {'; '.join(diffs)}: use another --out or the same settings"
        )


def _prepare(sample_id: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise HstapError(f"sample {sample_id!r}: tensor {name!r} is a {type(t).__name__}, expected a torch.Tensor")
    if t.dim() == 0:
        raise HstapError(f"sample {sample_id!r}: tensor {name!r} is a scalar; dim 0 must be the token axis")
    if name == "input_ids" and t.dtype != torch.int32:
        if t.is_floating_point() or t.dtype == torch.bool:
            raise HstapError(
                f"sample {sample_id!r}: tensor 'input_ids' has dtype {dtype_name(t.dtype)}, expected integers"
            )
        if t.numel() and (int(t.max()) > INT32.max or int(t.min()) < INT32.min):
            raise HstapError(f"sample {sample_id!r}: tensor 'input_ids' has ids outside int32, which the store uses")
        t = t.to(torch.int32)
    return t.detach()


def _check_lengths(sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
    if not tensors:
        raise HstapError(f"sample {sample_id!r} has no tensors")
    lengths = {name: int(t.shape[0]) for name, t in tensors.items()}
    first_name, first = next(iter(lengths.items()))
    for name, n in lengths.items():
        if n != first:
            raise HstapError(
                f"sample {sample_id!r}: tensor {name!r} has {n} tokens (dim 0) but {first_name!r} has {first}"
            )
    if first == 0:
        raise HstapError(f"sample {sample_id!r}: tensor {first_name!r} has 0 tokens; nothing to store")


def _check_against_specs(sample_id: str, tensors: dict[str, torch.Tensor], specs: dict[str, TensorSpec]) -> None:
    missing, extra = sorted(set(specs) - set(tensors)), sorted(set(tensors) - set(specs))
    if missing or extra:
        raise HstapError(
            f"sample {sample_id!r}: tensor set differs from the store's: missing {missing}, unexpected {extra}"
        )
    for name, t in tensors.items():
        spec = specs[name]
        if dtype_name(t.dtype) != spec.dtype:
            raise HstapError(
                f"sample {sample_id!r}: tensor {name!r} has dtype {dtype_name(t.dtype)}, the store has {spec.dtype}"
            )
        if list(t.shape[1:]) != spec.shape:
            raise HstapError(
                f"sample {sample_id!r}: tensor {name!r} has per-token shape {list(t.shape[1:])}, "
                f"the store has {spec.shape}"
            )


def _check_hidden_against_meta(sample_id: str, specs: dict[str, TensorSpec], meta: StoreMeta) -> None:
    """The first sample fixes the specs: make sure its `hidden.{k}` agree with what the manifest will claim."""
    hidden = {layer: (name, spec) for name, spec in specs.items() if (layer := hidden_layer(name)) is not None}
    if not hidden:
        return
    if sorted(hidden) != sorted(meta.layer_ids):
        raise HstapError(
            f"sample {sample_id!r}: tensors {sorted(n for n, _ in hidden.values())} do not match "
            f"layer_ids={meta.layer_ids} in the store meta"
        )
    for layer, (name, spec) in hidden.items():
        if spec.dtype != meta.hidden_dtype or spec.shape != [meta.hidden_size]:
            raise HstapError(
                f"sample {sample_id!r}: tensor {name!r} is {spec.dtype} {spec.shape}, the store meta says "
                f"{meta.hidden_dtype} [{meta.hidden_size}]"
            )
        scale = specs.get(scale_name(layer))
        if meta.hidden_dtype == "fp8" and (scale is None or scale.dtype != "fp32" or scale.shape != []):
            raise HstapError(
                f"sample {sample_id!r}: fp8 tensor {name!r} needs {scale_name(layer)!r} (fp32, one per token), "
                f"got {f'{scale.dtype} {scale.shape}' if scale else 'none'}"
            )
