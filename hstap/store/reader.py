"""Read a store lazily: the index comes from the manifest alone, shards open on demand, only a sample's rows are read.

    from hstap.store import open_store, verify_store
    store = open_store("runs/cap")
    s = store[0]      # {"id", "input_ids": [S] int64, "loss_mask": [S] bool, "hidden": {14: [S, H]}, "teacher": {...}}
    problems = verify_store("runs/cap")      # [] when every listed shard is present, complete and unmodified
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open

from hstap.errors import HstapError
from hstap.store.config import PROJECT_SAMPLES
from hstap.store.estimate import bytes_per_token, conventional_specs, human_bytes, projected_bytes
from hstap.store.fp8 import dequantize_sample
from hstap.store.manifest import (
    MANIFEST_NAME,
    Manifest,
    SampleEntry,
    ShardInfo,
    Totals,
    load_manifest,
    shard_files,
)
from hstap.store.names import hidden_layer, hidden_name, scale_layer

OPEN_SHARDS = 4  # handles kept open: enough for sequential reads and a shuffled window, few file descriptors
HASH_CHUNK = 8 << 20
TOKEN_KEYS = frozenset({"input_ids", "loss_mask"})
DAMAGED_HINT = "`hstap store verify` lists every problem; `hstap train --skip-bad-shards` leaves damaged shards out"


@dataclass
class SkippedShard:
    """A damaged shard `open_store(skip_bad_shards=True)` left out, with what it would have given."""

    file: str
    problem: str
    samples: int
    tokens: int


class Store:
    """Random access to a committed store. Threads may read at once (the trainer's batch thread beside held-out
    evaluation): a lock guards the handle cache and the checksum set; DataLoader worker processes are fine too.

    The first read of whole samples from a shard checks that shard's sha256 against the manifest (once per shard
    and process: one extra sequential read of it), so a flipped byte stops the reader with the shard's name
    instead of feeding wrong numbers on. Token-only reads (`keys` ⊆ input_ids, loss_mask: vocabulary counts)
    skip the check, so opening a large store stays cheap.
    """

    def __init__(self, path: Path, manifest: Manifest, skipped: list[SkippedShard] | None = None,
                 checksums: bool = True) -> None:
        self.path = path
        self.manifest = manifest
        self.skipped = skipped or []
        self.checksums = checksums
        self._verified: set[int] = set()
        # (shard index, entry) per sample in store order: shard order, then sample order within the shard
        self._index: list[tuple[int, SampleEntry]] = [
            (i, e) for i, shard in enumerate(manifest.shards) for e in shard.samples
        ]
        self._by_id = {e.id: n for n, (_, e) in enumerate(self._index)}
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample, read from its shard's rows only; negative indices count from the end."""
        return self.read(i)

    def read(self, i: int, keys: set[str] | None = None, dequantize: bool = True) -> dict[str, Any]:
        """Like `store[i]`, reading only the tensors named in `keys` (e.g. {"input_ids", "loss_mask"} to count
        tokens without touching the hidden states; an fp8 layer's scales come with it).

        An fp8 store's hidden states come back as bf16 (`hstap.store.fp8.dequantize`); with `dequantize=False`
        they stay float8_e4m3fn and their scales come as `sample["hidden_scale"][k]` (S,) fp32, for a trainer
        that dequantises after the copy to its device."""
        n = len(self._index)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n} samples")
        shard_idx, entry = self._index[i]
        with self._lock:
            if keys is None or not keys <= TOKEN_KEYS:
                self._check_once(shard_idx)
            handle = self._handle(shard_idx)
        rows = slice(entry.offset, entry.offset + entry.length)
        sample: dict[str, Any] = {"id": entry.id, "hidden": {}, "teacher": {}}
        for name in self.manifest.tensors:
            if keys is not None and name not in keys and not _scale_of(name, keys):
                continue
            try:
                t = handle.get_slice(name)[rows]  # (S, *shape)
            except Exception as exc:  # noqa: BLE001 — safetensors raises its own types for damaged files
                raise HstapError(f"shard {self.path / self.manifest.shards[shard_idx].file}: cannot read tensor "
                                 f"{name!r} ({exc}): the store is damaged; {DAMAGED_HINT}") from None
            if name == "input_ids":
                sample[name] = t.long()  # int32 on disk, int64 for embedding lookups
            elif hidden_layer(name) is not None:
                sample["hidden"][hidden_layer(name)] = t
            elif scale_layer(name) is not None:
                sample.setdefault("hidden_scale", {})[scale_layer(name)] = t
            elif name.startswith("teacher."):
                sample["teacher"][name[8:]] = t
            else:
                sample[name] = t
        return dequantize_sample(sample) if dequantize else sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def ids(self) -> list[str]:
        """Sample ids in store order."""
        return [e.id for _, e in self._index]

    def index_of(self, sample_id: str) -> int:
        """Position of `sample_id`; KeyError if absent."""
        try:
            return self._by_id[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in store {self.path}") from None

    def close(self) -> None:
        """Drop the cached shard handles (safetensors closes a file when its handle is collected)."""
        self._handles.clear()

    def __getstate__(self) -> dict[str, Any]:
        # Handles don't pickle; DataLoader workers reopen shards themselves.
        return {**self.__dict__, "_handles": OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _check_once(self, shard_idx: int) -> None:
        if not self.checksums or shard_idx in self._verified:
            return
        shard = self.manifest.shards[shard_idx]
        problem = listed_problem(self.path, shard)
        if problem is None and sha256_file(self.path / shard.file) != shard.sha256:
            problem = f"{shard.file}: sha256 mismatch (contents changed since commit)"
        if problem:
            raise HstapError(f"store {self.path}: {problem}; {DAMAGED_HINT}")
        self._verified.add(shard_idx)

    def _handle(self, shard_idx: int) -> Any:
        if shard_idx in self._handles:
            self._handles.move_to_end(shard_idx)
            return self._handles[shard_idx]
        file = self.path / self.manifest.shards[shard_idx].file
        if not file.exists():
            raise HstapError(f"shard {file} is listed in the manifest but missing: the store is damaged; "
                             f"{DAMAGED_HINT}")
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # noqa: BLE001 — SafetensorError for a damaged header
            raise HstapError(f"shard {file}: not a readable safetensors file ({exc}): the store is damaged; "
                             f"{DAMAGED_HINT}") from None
        self._handles[shard_idx] = handle
        if len(self._handles) > OPEN_SHARDS:
            self._handles.popitem(last=False)
        return handle


def _scale_of(name: str, keys: set[str]) -> bool:
    """`hidden_scale.k` is read whenever `hidden.k` is: the fp8 values mean nothing without it."""
    layer = scale_layer(name)
    return layer is not None and hidden_name(layer) in keys


def _load(path: Path | str) -> tuple[Path, Manifest]:
    path = Path(path)
    file = path / MANIFEST_NAME
    if not file.exists():
        shards = shard_files(path)
        if shards:
            raise HstapError(f"no {MANIFEST_NAME} in {path}, but {len(shards)} shard files: re-run the same "
                             "`hstap capture` command on it to rebuild the manifest from the shard headers")
        raise HstapError(f"no {MANIFEST_NAME} in {path}: not an hstap store (or nothing committed yet)")
    return path, load_manifest(file)


def listed_problem(path: Path, shard: ShardInfo) -> str | None:
    """The cheap check of a listed shard (one stat): present, with the size the manifest recorded."""
    try:
        size = (path / shard.file).stat().st_size
    except FileNotFoundError:
        return f"{shard.file}: missing ({len(shard.samples)} samples listed in it)"
    if size != shard.bytes:
        return f"{shard.file}: {size} bytes on disk, manifest says {shard.bytes} (truncated or replaced)"
    return None


def unlisted_shards(path: Path, manifest: Manifest) -> list[str]:
    """Shard files in `path` that the manifest does not list (not part of the store)."""
    listed = {s.file for s in manifest.shards}
    return [f.name for f in shard_files(path) if f.name not in listed]


def open_store(path: Path | str, skip_bad_shards: bool = False) -> Store:
    """Open a store for reading: the manifest, and one stat per listed shard (present, recorded size).

    `skip_bad_shards`: check every shard fully (size, sha256, tensors: one read of the whole store) and leave the
    damaged ones out; `store.skipped` says which, with their samples and tokens.

    Raises:
        HstapError: no manifest in `path`, an unreadable one, or (unless skipping) a missing or truncated shard,
            named.
    """
    path, manifest = _load(path)
    if not skip_bad_shards:
        for shard in manifest.shards:
            problem = listed_problem(path, shard)
            if problem:
                raise HstapError(f"store {path}: {problem}; {DAMAGED_HINT}")
        return Store(path, manifest)
    skipped = []
    for shard in manifest.shards:
        problems = _shard_problems(path, shard, manifest)
        if problems:
            skipped.append(SkippedShard(shard.file, problems[0], len(shard.samples), shard.num_tokens))
    bad = {s.file for s in skipped}
    kept = [s for s in manifest.shards if s.file not in bad]
    store = Store(path, manifest.model_copy(update={"shards": kept, "totals": Totals.of(kept)}), skipped=skipped)
    store._verified = set(range(len(kept)))  # every kept shard was just hashed
    return store


def sha256_file(file: Path) -> str:
    """The hex sha256 of `file`, read in HASH_CHUNK pieces (shards, and drafters' weights: hstap.drafter.integrity)."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _shard_problems(path: Path, shard: ShardInfo, manifest: Manifest) -> list[str]:
    file = path / shard.file
    problem = listed_problem(path, shard)
    if problem:
        return [problem]
    if sha256_file(file) != shard.sha256:
        return [f"{shard.file}: sha256 mismatch (contents changed since commit)"]
    problems = []
    lengths = sum(e.length for e in shard.samples)
    if lengths != shard.num_tokens:
        problems.append(f"{shard.file}: sample lengths sum to {lengths}, manifest says num_tokens={shard.num_tokens}")
    try:
        f = safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 — the checksum matched a file that was never a valid shard
        return [f"{shard.file}: not a readable safetensors file ({exc})"]
    keys = set(f.keys())
    for name, spec in manifest.tensors.items():
        if name not in keys:
            problems.append(f"{shard.file}: tensor {name!r} missing")
            continue
        shape = f.get_slice(name).get_shape()
        if shape != [shard.num_tokens, *spec.shape]:
            problems.append(f"{shard.file}: tensor {name!r} has shape {shape}, expected "
                            f"{[shard.num_tokens, *spec.shape]}")
    return problems


def _manifest_problems(path: Path, manifest: Manifest) -> list[str]:
    """What needs no shard read: totals against the shard list, and shard files the manifest does not list."""
    problems = []
    t, s = manifest.totals, Totals.of(manifest.shards)
    if t != s:
        problems.append(f"{MANIFEST_NAME}: totals say {t.samples} samples / {t.tokens} tokens / {t.bytes} bytes, "
                        f"shards add up to {s.samples} / {s.tokens} / {s.bytes}")
    for name in unlisted_shards(path, manifest):
        problems.append(f"{name}: on disk but not listed in {MANIFEST_NAME}, so not part of the store (an "
                        "interrupted commit's shard, which the next capture adopts, or the manifest is older than "
                        "the shards)")
    return problems


def verify_store(path: Path | str) -> list[str]:
    """Check every listed shard (present, size, sha256, tensor shapes), the totals and unlisted shard files; []
    when all is well.

    Reads every byte of the store (streamed), so it costs one full pass over the disk.
    """
    path, manifest = _load(path)
    problems: list[str] = []
    for shard in manifest.shards:
        problems += _shard_problems(path, shard, manifest)
    problems += _manifest_problems(path, manifest)
    seen: dict[str, str] = {}
    for shard in manifest.shards:
        for e in shard.samples:
            if e.id in seen:
                problems.append(f"{shard.file}: sample {e.id!r} also in {seen[e.id]}")
            seen[e.id] = shard.file
    return problems


def store_info(path: Path | str, project: list[int] | tuple[int, ...] = PROJECT_SAMPLES) -> dict[str, Any]:
    """Summary for `hstap store info`, from the manifest and file sizes only (no shard is read).

    The counts are summed from the shard list, not copied from the manifest's totals; `problems` names every
    listed shard that is missing or has another size than recorded (one stat each), totals that disagree with
    the shard list, and shard files the manifest does not list. Checksums need a full read: `verify_store`.
    `bytes_per_token` is measured: the committed shards' bytes (headers included) over their tokens.
    `bytes_per_token_estimate` is what capture's disk estimate computes from the tensor specs
    (`hstap.store.estimate.bytes_per_token`), `teacher_bytes_per_token` the teacher's part of it, and `projected`
    the size of a store of N samples of this store's mean length at the measured rate."""
    path, manifest = _load(path)
    meta, totals = manifest.meta, Totals.of(manifest.shards)
    on_disk = sum((path / s.file).stat().st_size for s in manifest.shards if (path / s.file).exists())
    problems = [p for s in manifest.shards if (p := listed_problem(path, s))] + _manifest_problems(path, manifest)
    specs = manifest.tensors or conventional_specs(meta)
    per_token = totals.bytes / totals.tokens if totals.tokens else 0.0
    per_sample = totals.tokens / totals.samples if totals.samples else 0.0
    return {
        "path": str(path),
        "samples": totals.samples,
        "tokens": totals.tokens,
        "shards": len(manifest.shards),
        "layer_ids": meta.layer_ids,
        "hidden_size": meta.hidden_size,
        "hidden_dtype": meta.hidden_dtype,
        "teacher": str(meta.teacher),
        "tensors": {n: f"{s.dtype}{s.shape}" for n, s in manifest.tensors.items()},
        "bytes_per_token": per_token,
        "bytes_per_token_estimate": bytes_per_token(specs),
        "teacher_bytes_per_token": bytes_per_token({n: s for n, s in specs.items() if n.startswith("teacher.")}),
        "tokens_per_sample": per_sample,
        "bytes_on_disk": on_disk,
        "size": human_bytes(on_disk),
        "projected": {int(n): human_bytes(projected_bytes(per_token, per_sample, n)) for n in project},
        "model_id": meta.model_id,
        "model_fingerprint": meta.model_fingerprint,
        "created": manifest.created,
        "updated": manifest.updated,
        "problems": problems,
    }
