"""Checkpoints that resume exactly: drafter weights, optimizer, scheduler, RNG and the position in the data plan.

Written atomically (temp dir + rename) by rank 0; every rank reads the same files on resume.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
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
    if dist.rank != 0:
        dist.barrier()
        return
    final = Path(out) / CKPT
    tmp = Path(out) / f".{CKPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({
        "drafter": drafter.trainable_state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "state": asdict(state),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }, tmp / "trainer.pt")
    fault_point("checkpoint-written")  # HSTAP_FAULT: a crash between writing and renaming into place
    old = Path(out) / f".{CKPT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    # metrics written after this checkpoint are replayed by the resumed run: remember where to cut
    metrics = Path(out) / "metrics.jsonl"
    (final / "metrics_bytes").write_text(str(metrics.stat().st_size if metrics.exists() else 0))
    dist.barrier()


def load(out: Path, drafter, optimizer, scheduler) -> State:
    path = Path(out) / CKPT / "trainer.pt"
    if not path.exists():
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
    cut = Path(out) / CKPT / "metrics_bytes"
    metrics = Path(out) / "metrics.jsonl"
    if cut.exists() and metrics.exists():
        with open(metrics, "r+") as f:
            f.truncate(int(cut.read_text()))
    known = set(State.__dataclass_fields__)
    if set(blob["state"]) - known:
        raise HstapError(f"{path}: checkpoint written by an older hstap (state fields {sorted(blob['state'])}); "
                         f"it cannot be resumed: start the run again without --resume")
    return State(**blob["state"])
