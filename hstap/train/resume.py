"""What `hstap train --resume` may change, and when there is nothing left to resume.

    hstap train --store S --out R --epochs 1                       # a run
    hstap train --store S --out R --epochs 3 --resume              # applied: trains epochs 2 and 3, recorded
    hstap train --store S --out R --epochs 3 --lr 3e-3 --resume    # refused in one line naming --lr, both values
    hstap train --store S --out R --epochs 3 --resume              # again: "already finished at step N", no write

The rule, flag by flag (`train_config.json` holds the run's values; a resumed run rewrites it with the ones it runs
with):
- **refused** when changed (`SAME`), each named in one line: what the run learns from and how — the target, the data
  and its split, the draft model's shape, the optimizer and the schedule's shape (`--lr`, `--warmup-ratio`,
  `--weight-decay`, `--grad-clip`), `--batch-tokens` (the data plan: a mid-epoch position means other batches
  under another size) and `--time-budget`. A resumed run must continue the run it resumes, not half of another.
  `--init-from` only starts a run: left out on a resume, the run's own is kept (and recorded); another is refused.
  `--draft-vocab`/`--draft-intermediate` are checked against the drafter itself (hstap.train.build) and
  `--grad-accum` through the global batch (ranks × it must stay the same).
- **applied and recorded** (`LENGTH`): `--epochs` and `--max-steps`. The schedule's length is recomputed from them:
  from the resumed step on, the learning rate is the one a run planned with the new length has at that step (a
  longer run decays more slowly; a finished run extended restarts at that point of the new cosine). A run under a
  `--time-budget` takes its length from the budget (a resume fits the rest into the time left), so there they are
  refused.
- **applied and recorded**: everything else, which changes how the run executes, not what it computes (device,
  kernels, compile, prefetch, checkpoint interval, calibration prompts, `--skip-bad-shards`).

A run is finished when its checkpoint is past the last step the (possibly new) flags ask for and the run's
`model.safetensors` is the one written at that step (its safetensors metadata records the step): `--resume` then
says so in one line and writes nothing. Killed after its last checkpoint but before its drafter was written, it is
not finished: the resume evaluates and writes the drafter without training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hstap.errors import HstapError
from hstap.train.config import TrainConfig

SAME = ("store", "online", "model", "data", "limit", "layers", "max_tokens", "loops", "online_dtype", "seed", "heldout",
        "loss_on", "ttt_steps", "decay", "lr", "warmup_ratio", "weight_decay", "grad_clip", "batch_tokens",
        "time_budget_s", "init_from")
START = ("init_from",)  # read when a run starts: a resume that leaves it out keeps the run's
LENGTH = ("epochs", "max_steps")
PATHS = ("store", "init_from")  # compared as absolute paths: `runs/cap` and `./runs/cap` are one store


def _shown(name: str, value) -> str:
    from hstap.config import flag_of

    flag = flag_of(TrainConfig, name)
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {'unset' if value is None else value}"


def _comparable(name: str, value):
    if name in PATHS and value is not None:
        return os.path.abspath(str(value))
    return value


def recorded_config(out: Path) -> dict | None:
    """The run's `train_config.json` as written when it started (or last resumed); None when there is none or it
    cannot be read (a run directory of an hstap that wrote none: its flags cannot be compared)."""
    try:
        recorded = json.loads((Path(out) / "train_config.json").read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def changed_flags(out: Path, cfg: TrainConfig) -> dict[str, tuple]:
    """The `LENGTH` flags this `--resume` changes, {field: (run's value, this command's)}; HstapError naming every
    refused change at once. `cfg`: sized for the device (TrainConfig.sized_for_device)."""
    recorded = recorded_config(out)
    if recorded is None:
        return {}
    now = cfg.model_dump(mode="json")
    differ = {name: (recorded[name], now[name]) for name in (*SAME, *LENGTH)
              if name in recorded and _comparable(name, recorded[name]) != _comparable(name, now[name])
              and not (name in START and now[name] is None)}
    refused = [name for name in differ if name in SAME]
    if recorded.get("time_budget_s") is not None:  # a budgeted run keeps the length it was fitted to
        refused += [name for name in differ if name in LENGTH]
    if refused:
        was = ", ".join(_shown(name, differ[name][0]) for name in refused)
        now_ = ", ".join(_shown(name, differ[name][1]) for name in refused)
        why = ("a run under --time-budget takes its length from the budget; " if recorded.get("time_budget_s") is not None
               and any(name in LENGTH for name in refused) else "")
        raise HstapError(f"--resume: the run in {out} was started with {was}; this command gives {now_}: {why}a "
                         "resumed run continues that run, so pass its values (or start a new run: --init-from a "
                         "finished run's directory keeps its weights)")
    return {name: pair for name, pair in differ.items() if name in LENGTH}


def as_recorded(out: Path, cfg: TrainConfig) -> TrainConfig:
    """`cfg` as a resumed run records it in train_config.json: the `START` flags it left out are the run's."""
    recorded = recorded_config(out) or {}
    kept = {name: recorded[name] for name in START if getattr(cfg, name) is None and recorded.get(name) is not None}
    return cfg.model_copy(update=kept) if kept else cfg


def saved_step(weights: Path) -> int | None:
    """The training step `hstap train` recorded in a drafter's safetensors metadata when it wrote it; None for a
    drafter written otherwise (or before 2026-12). HstapError when its header cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("hstap", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise HstapError(f"{weights}: unreadable header ({exc})") from None
    step = meta.get("step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) else None


def drafter_written_at(out: Path, step: int) -> bool:
    """Whether `out`/model.safetensors is the drafter of `step`: its recorded step is that one, or (a drafter
    written before steps were recorded) it is there at all. A damaged one is not: the resume writes it again."""
    weights = Path(out) / "model.safetensors"
    if not weights.is_file():
        return False
    try:
        recorded = saved_step(weights)
    except HstapError:
        return False
    return recorded is None or recorded == step


def logged_eval(out: Path, step: int) -> dict | None:
    """The held-out evaluation metrics.jsonl already holds for `step`, without its coordinates: a resume that has
    nothing to train (killed after the last checkpoint, before the drafter was written) does not evaluate twice."""
    found = []
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "eval" and record.get("step") == step:
            found.append(record)
    return {k: v for k, v in found[-1].items() if k not in ("kind", "epoch", "step")} if found else None


def write_config(out: Path, cfg: TrainConfig) -> None:
    """train_config.json: the flags the run runs with (rewritten by a resume), renamed into place whole."""
    tmp = Path(out) / "train_config.json.tmp"
    tmp.write_text(cfg.model_dump_json(indent=2) + "\n")
    tmp.replace(Path(out) / "train_config.json")


def reschedule(schedule, scheduler, total: int) -> None:
    """A resumed run's schedule (`schedule`: the WarmupCosine inside LambdaLR `scheduler`) over `total` steps (its
    --epochs/--max-steps changed, or not): from the resumed step on, each learning rate is what a run planned with
    that length has there, the next step's included."""
    if schedule.total == total:
        return
    schedule.total = total
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * schedule(scheduler.last_epoch)  # last_epoch: optimizer steps taken so far
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
