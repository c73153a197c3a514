"""Checkpoints that resume exactly: drafter weights, optimizer, scheduler, RNG and the position in the data plan.

Written atomically (temp dir + rename) by rank 0; every rank reads the same files on resume. A checkpoint also
records how much of metrics.jsonl it covers: a resumed run cuts the file back there (records of the steps it
replays would otherwise appear twice). A write that fails (a full disk) removes its temp directory, keeps the
previous checkpoint, and stops the run with a one-line error on every rank.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hstap.data.appender import append_line
from hstap.errors import HstapError
from hstap.faults import fault_point

CKPT = "checkpoint"


@dataclass
class State:
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps taken in this epoch (each consumes batches_per_step plan batches)
    batches_per_step: int = 1  # ranks × grad_accum: a resumed run must take the same (any split of it)
    train_tokens: int = 0
    initial_heldout: dict = field(default_factory=dict)


class MetricsLog:
    """Append-only JSONL, one record per step or evaluation, mirrored as TensorBoard scalars when `tensorboard`
    names a directory (hstap.train.tblog); rank 0 only."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard: Path | None = None,
                 purge_step: int | None = None):
        from hstap.train.tblog import TensorBoardLog

        self.path, self.enabled = Path(path), enabled
        self.tb = TensorBoardLog(tensorboard, purge_step) if enabled and tensorboard is not None else None

    def write(self, record: dict) -> None:
        """Append one record as one line (or, on a full disk, leave the file whole and raise HstapError)."""
        if self.enabled:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                append_line(fd, (json.dumps(record) + "\n").encode("utf-8"), self.path,
                            "the records before it are whole and kept; the checkpoint is unchanged")
            finally:
                os.close(fd)
            if self.tb is not None:
                self.tb.write(record)

    def flush(self) -> None:
        """Make everything written so far visible to a TensorBoard watching the run (at every evaluation)."""
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def save(out: Path, drafter, optimizer, scheduler, state: State, dist) -> None:
    """Write the checkpoint of `state.step` (rank 0) and rename it into place; every rank returns together, or
    every rank raises HstapError when rank 0 could not write it (the previous checkpoint stays)."""
    error = None
    if dist.rank == 0:
        try:
            _write(Path(out), drafter, optimizer, scheduler, state)
        except (OSError, RuntimeError) as exc:
            error = os_error(exc)
            if error is None:
                raise
    if dist.agree_max(float(error is not None)):  # every rank learns it: none waits forever in a barrier
        kept = read_meta(Path(out))
        earlier = f"the checkpoint of step {kept['step']} is kept" if kept else \
            "the earlier checkpoint is kept" if exists(Path(out)) else None
        then = "run the same command with --resume" if earlier else "start again with --overwrite"
        why = (error.strerror or str(error)) if error is not None else "rank 0 could not write it"
        raise HstapError(f"{Path(out) / CKPT}: {why} while writing the checkpoint of step {state.step}; "
                         f"{earlier or 'there is no earlier checkpoint'}: free space, then {then}")


def _write(out: Path, drafter, optimizer, scheduler, state: State) -> None:
    final, tmp = out / CKPT, out / f".{CKPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fault_point("checkpoint-write")  # HSTAP_FAULT=checkpoint-write:N:enospc: the disk is full at the N-th
        with open(tmp / "trainer.pt", "wb") as f:  # through a file object: a full disk shows as OSError (os_error)
            torch.save({
                "drafter": drafter.trainable_state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "state": asdict(state),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            }, f)
        # metrics written after this checkpoint are replayed by the resumed run: remember where to cut
        meta = {"step": state.step, "metrics_bytes": _synced_size(out / "metrics.jsonl")}
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
    fault_point("checkpoint-written")  # HSTAP_FAULT: a crash between writing and renaming into place
    old = out / f".{CKPT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def cover_metrics(out: Path) -> None:
    """Make the checkpoint in `out` cover metrics.jsonl as it is now (rank 0): the final evaluation is logged after
    the last step's checkpoint, and a run extended later (`--resume --epochs N`) must keep it, not cut it away."""
    meta = read_meta(Path(out))
    if meta is None:
        return
    meta["metrics_bytes"] = _synced_size(Path(out) / "metrics.jsonl")
    path = Path(out) / CKPT / "meta.json"
    tmp = path.with_name("meta.json.tmp")
    tmp.write_text(json.dumps(meta) + "\n")
    os.replace(tmp, path)


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: torch.save reports a full disk as RuntimeError("unexpected pos …") raised while
    closing the archive, the write's OSError(ENOSPC) in its context (when writing through a file object)."""
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _synced_size(path: Path) -> int:
    """Size of `path` once its bytes are on disk: a power loss cannot leave it shorter than a checkpoint says."""
    if not path.exists():
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_meta(out: Path) -> dict | None:
    """`{"step", "metrics_bytes"}` of the checkpoint in `out`, or None when there is none."""
    path = Path(out) / CKPT / "meta.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def exists(out: Path) -> bool:
    """Whether `out` holds a checkpoint, after putting one back in place if a kill fell between the two renames
    of `_write` (the old one moved aside, the new one not yet in place): the new one when it was written whole
    (its meta.json comes last), else the old one."""
    out = Path(out)
    final, tmp, old = out / CKPT, out / f".{CKPT}.tmp", out / f".{CKPT}.old"
    if not final.exists() and old.exists():
        os.replace(tmp if (tmp / "meta.json").is_file() else old, final)
    return (final / "trainer.pt").is_file()


def load(out: Path, drafter, optimizer, scheduler) -> State:
    """Restore the drafter, optimizer, scheduler and RNG from `out`'s checkpoint; nothing in `out` is written (the
    metrics are cut by `cut_to`, once the run is known to continue)."""
    path = Path(out) / CKPT / "trainer.pt"
    if not exists(out):
        raise HstapError(f"--resume: no checkpoint at {path}; run without --resume to start fresh")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    missing, unexpected = drafter.load_state_dict(blob["drafter"], strict=False)
    if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
        raise HstapError(f"{path}: checkpoint does not fit this drafter (missing {missing}, unexpected {unexpected})")
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["rng"]["torch"])
    random.setstate(blob["rng"]["python"])
    if blob["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["rng"]["cuda"])
    known = set(State.__dataclass_fields__)
    if set(blob["state"]) - known:
        raise HstapError(f"{path}: checkpoint written by an older hstap (state fields {sorted(blob['state'])}); "
                         f"it cannot be resumed: start the run again without --resume")
    return State(**blob["state"])


def cut_to(out: Path, step: int) -> None:
    """Cut `out`/metrics.jsonl back to what the checkpoint (of `step`) covers: a resumed run replays the steps after
    it (rank 0, after `load`, once the run is known to continue)."""
    cut = Path(out) / CKPT / "metrics_bytes"  # checkpoints written before meta.json
    meta = read_meta(out) or ({"metrics_bytes": int(cut.read_text())} if cut.exists() else {})
    cut_metrics(Path(out) / "metrics.jsonl", meta.get("metrics_bytes"), step)


def cut_metrics(path: Path, size: int | None, step: int) -> None:
    """Cut metrics.jsonl back to what the checkpoint of `step` covered: its first `size` bytes when they end a
    line, else (a file shortened, rewritten, or padded with NUL bytes by hstap before 2026-12) its whole records
    up to `step`, said on stderr. Never extends the file."""
    if not path.exists():
        return
    data = path.read_bytes()
    if size is not None and size <= len(data) and (size == 0 or data[size - 1:size] == b"\n"):
        keep = data[:size]
    else:
        lines = [line.lstrip(b"\0") for line in data.splitlines(keepends=True)]
        steps = [_step_of(line) for line in lines]
        kept = [line.rstrip(b"\r\n") + b"\n" for line, k in zip(lines, steps) if k is not None and k <= step]
        keep = b"".join(kept)
        print(f"hstap train: {path} did not match its checkpoint (step {step}, {size} bytes; the file has "
              f"{len(data)}): kept its {len(kept)} whole records up to step {step}, dropped "
              f"{sum(1 for line in lines if line.strip()) - len(kept)} lines", file=sys.stderr, flush=True)
    if keep != data:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(keep)
        os.replace(tmp, path)


def _step_of(line: bytes) -> int | None:
    """The `step` of one metrics line, or None when it is not a whole JSON record."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None
