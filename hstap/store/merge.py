"""One store from several: the stores each node of a multi-node capture wrote, read by one training run.

Across nodes, capture runs one engine per node behind a router, and every node writes its own store
(docs/distributed.md). `hstap store merge --out ALL A B C` makes one store of them without rewriting a shard:
committed shards are immutable, so each one is hard-linked into OUT under its new number (no bytes copied, no
space taken), or copied where OUT is on another filesystem, its sha256 checked against the manifest as it streams.
The manifest is written last, in one atomic rename: until then OUT is not a store, and a merge killed on the way
(kill -9 in the middle of a terabyte of copies) is run again with the same command and keeps every shard already
in place (a copy lands under its final name only once complete).

    merge_stores(Path("runs/all"), [Path("node0/cap"), Path("node1/cap")])   # MergeReport(shards=.., linked=.., ..)

Refused, in one line naming the store and the field: stores of another target, layers, hidden size, dtype,
teacher or tensor set, or captured with other `--loops` or `--target-dtype` settings; a sample id in two stores
(a merged store must not train on one conversation twice); an input with a listed shard missing or truncated; an
OUT that already holds a store, or is one of the inputs. Settings that may differ between the inputs (the data
each node read, its engine) are kept per input in the manifest's `extra.merged_from`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path


from hstap.errors import HstapError
from hstap.preflight import check_out_dir
from hstap.progress import progress_bar
from hstap.store.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    StoreMeta,
    Totals,
    atomic_write,
    fsync_dir,
    load_manifest,
    now_iso,
    save_manifest,
    shard_files,
    shard_name,
)
from hstap.store.reader import HASH_CHUNK, listed_problem
from hstap.faults import fault_point

SAME_EXTRA = ("loops", "target_dtype")  # capture settings that change what a sample holds: every input's must agree
PLAN_NAME = ".merge.json"  # the inputs of a merge under way, so a rerun of another merge is refused


@dataclass
class MergeReport:
    """What `merge_stores` did: shards hard-linked, copied, or found in place from an interrupted run."""

    out: Path
    samples: int
    tokens: int
    bytes: int
    shards: int
    linked: int
    copied: int
    kept: int

    @classmethod
    def of(cls, out: Path, manifest: Manifest, counts: dict[str, int]) -> MergeReport:
        t = manifest.totals
        return cls(out, t.samples, t.tokens, t.bytes, len(manifest.shards), counts["linked"], counts["copied"],
                   counts["kept"])


def _check_compatible(first: tuple[Path, Manifest], other: tuple[Path, Manifest]) -> None:
    (a, ma), (b, mb) = first, other
    mine, theirs = ma.meta.model_dump(exclude={"extra"}), mb.meta.model_dump(exclude={"extra"})
    for field, value in mine.items():
        if theirs[field] != value:
            raise HstapError(f"{b}: meta.{field} is {theirs[field]}, {a} has {value}: stores merge only when they "
                             "were captured from one target with the same layers, dtype and teacher")
    if mb.tensors != ma.tensors:
        raise HstapError(f"{b}: tensors {_specs(mb)} differ from {a}'s {_specs(ma)}")
    for key in SAME_EXTRA:
        if ma.meta.extra.get(key) != mb.meta.extra.get(key):
            raise HstapError(f"{b}: captured with {key}={mb.meta.extra.get(key)!r}, {a} with "
                             f"{ma.meta.extra.get(key)!r}: re-capture one of them with the other's setting")


def _specs(m: Manifest) -> str:
    return ", ".join(f"{name} {spec.dtype}{spec.shape}" for name, spec in sorted(m.tensors.items()))


def _merged_meta(inputs: list[tuple[Path, Manifest]]) -> StoreMeta:
    """The first input's meta; `extra` keeps the values every input agrees on, and each input's own under
    `merged_from` (with its sample count), so nothing a capture recorded is lost."""
    extras = [m.meta.extra for _, m in inputs]
    agreed = {k: v for k, v in extras[0].items() if k != "merged_from" and all(e.get(k) == v for e in extras)}
    sources = [{"store": str(path), "samples": m.totals.samples, **m.meta.extra} for path, m in inputs]
    return inputs[0][1].meta.model_copy(update={"extra": {**agreed, "merged_from": sources}})


def _check_unique_ids(inputs: list[tuple[Path, Manifest]]) -> None:
    seen: dict[str, Path] = {}
    twice: list[tuple[str, Path, Path]] = []
    for path, m in inputs:
        for shard in m.shards:
            for e in shard.samples:
                if e.id in seen:
                    twice.append((e.id, seen[e.id], path))
                else:
                    seen[e.id] = path
    if twice:
        sample, a, b = twice[0]
        raise HstapError(f"sample {sample!r} is in {a} and in {b} ({len(twice)} sample(s) in more than one input): "
                         "merge stores of different conversations, or leave one of them out")


def _copy_checked(src: Path, dst: Path, sha256: str) -> None:
    """Copy `src` to `dst` through `dst.tmp`, hashing as it streams; renamed into place only when the hash is the
    manifest's (a damaged input shard is named, not merged)."""
    tmp = dst.with_name(dst.name + ".tmp")
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(HASH_CHUNK):
                h.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if h.hexdigest() != sha256:
            raise HstapError(f"{src}: sha256 mismatch (contents changed since commit): `hstap store verify "
                             f"{src.parent}` lists every problem")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dst)


def _place(src: Path, dst: Path, shard: ShardInfo, copy: bool) -> str:
    """Put one shard at `dst`: 'kept' (an earlier run of this merge put it there), 'linked' or 'copied'."""
    if dst.exists():
        if dst.samefile(src) or dst.stat().st_size == shard.bytes:
            return "kept"  # a copy is renamed into place only once complete and checked
        dst.unlink()
    if not copy:
        try:
            os.link(src, dst)
            return "linked"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
    _copy_checked(src, dst, shard.sha256)
    return "copied"


def merge_stores(out: Path, stores: list[Path], copy: bool = False, progress: bool = True) -> MergeReport:
    """Merge `stores` into a new store at `out` (see the module). `copy`: copy every shard even where a hard link
    would do (OUT then shares no file with the inputs)."""
    out = Path(out)
    if len(stores) < 2:
        raise HstapError(f"store merge: {len(stores)} input store given, expected two or more")
    check_out_dir(out)  # a read-only or kernel-filesystem --out is named before any input is read
    inputs = [(Path(s), load_manifest(Path(s) / MANIFEST_NAME)) for s in stores]
    for path, _ in inputs:
        if out.exists() and path.exists() and path.resolve() == out.resolve():
            raise HstapError(f"--out {out} is one of the input stores: merge into a new directory")
    plan = json.dumps({"stores": [str(p.resolve()) for p, _ in inputs]}).encode()
    plan_file = out / PLAN_NAME
    if (out / MANIFEST_NAME).exists():
        if plan_file.exists() and plan_file.read_bytes() == plan:  # killed between the manifest and the tidy-up
            plan_file.unlink()
            done = load_manifest(out / MANIFEST_NAME)
            return MergeReport.of(out, done, {"linked": 0, "copied": 0, "kept": len(done.shards)})
        raise HstapError(f"--out {out} already holds a store ({MANIFEST_NAME}): merge into a new directory")
    for other in inputs[1:]:
        _check_compatible(inputs[0], other)
    _check_unique_ids(inputs)
    for path, m in inputs:
        for shard in m.shards:
            problem = listed_problem(path, shard)
            if problem:
                raise HstapError(f"{path}: {problem}; `hstap store verify {path}` lists every problem")

    out.mkdir(parents=True, exist_ok=True)
    if plan_file.exists() and plan_file.read_bytes() != plan:
        raise HstapError(f"--out {out} holds an interrupted merge of other stores ({PLAN_NAME}): rerun that merge, "
                         "or merge into a new directory")
    if not plan_file.exists():
        if shard_files(out):
            raise HstapError(f"--out {out} holds shard files and no {MANIFEST_NAME}: merge into a new directory")
        atomic_write(plan_file, plan)

    shards: list[ShardInfo] = []
    counts = {"kept": 0, "linked": 0, "copied": 0}
    todo = [(path, shard) for path, m in inputs for shard in m.shards]
    for index, (path, shard) in enumerate(progress_bar(todo, desc="merge", unit="shard", disable=not progress)):
        name = shard_name(index)
        try:
            counts[_place(path / shard.file, out / name, shard, copy)] += 1
            fault_point("merge-shard")  # HSTAP_FAULT=merge-shard:N: killed once N shards are in place
        except OSError as e:  # a full disk: what is in place stays, and the same command carries on from it
            raise HstapError(f"{out / name}: cannot write {path / shard.file} there ({e.strerror or e}); "
                             f"{index} of {len(todo)} shards are in place: rerun the same command to go on") from e
        shards.append(shard.model_copy(update={"file": name}))
    fsync_dir(out)
    stamp = now_iso()
    manifest = Manifest(meta=_merged_meta(inputs), tensors=inputs[0][1].tensors, shards=shards,
                        totals=Totals.of(shards), created=stamp, updated=stamp)
    save_manifest(out / MANIFEST_NAME, manifest)  # OUT is a store from here on
    fault_point("merge-manifest")  # HSTAP_FAULT=merge-manifest: killed with the store whole, the plan not removed
    plan_file.unlink()
    return MergeReport.of(out, manifest, counts)
