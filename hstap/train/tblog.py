"""Training metrics as TensorBoard scalars in OUT/tb, beside metrics.jsonl, so a long run can be watched live.

    tensorboard --logdir runs/drafter/tb

Every number in a metrics record becomes a scalar at the record's step, tagged by the record's kind and the path
to the number: `train/loss`, `train/step_losses/2`, `eval/acc/0`, `eval/tau_est/3`, `eval/calibration/gap`,
`budget/seconds_per_step`. metrics.jsonl stays the record of truth (plots, tests, resume); this is a view of it.
Rank 0 writes; the trainer flushes at every evaluation. A resumed run purges the events past its checkpoint's step,
as it truncates metrics.jsonl there.
"""

from __future__ import annotations

import sys
from pathlib import Path

SKIPPED = ("kind", "step", "epoch")  # the record's coordinates, not metrics


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} for every numeric leaf of `record` (nested dicts and lists walked, booleans and text skipped)."""
    out: dict[str, float] = {}

    def walk(tag: str, value) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{tag}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{tag}/{i}", item)

    kind = record.get("kind", "metrics")
    for key, value in record.items():
        if key not in SKIPPED:
            walk(f"{kind}/{key}", value)
    return out


class TensorBoardLog:
    """A SummaryWriter fed with metrics records. Without the `tensorboard` package (requirements.txt pins it) it
    says so once and records nothing: a training run never fails for want of a viewer."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            print(f"hstap train: no TensorBoard events ({exc}); metrics go to metrics.jsonl only. Install it with "
                  "`pip install tensorboard==2.21.0`", file=sys.stderr, flush=True)
            self.writer = None
            return
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = int(record.get("step", 0))
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
