"""The run directory's life: checks that need no model (run first, on every rank), no run written over by
accident, a fresh start on `--overwrite`, when to checkpoint, and the trained drafter's last write.

    hstap train --store runs/cap --out runs/d                  # runs/d holds a run: refused, in one line
    hstap train --store runs/cap --out runs/d --resume         # continue it from its checkpoint
    hstap train --store runs/cap --out runs/d --overwrite      # delete its run files, start afresh

Checkpoints come every `--checkpoint-interval` of wall time (5 minutes by default, so a short run killed early
loses minutes, not the run), also every `--checkpoint-every` steps if set, and always at the end.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hstap.errors import HstapError
from hstap.preflight import check_device, check_out_dir
from hstap.train import checkpoint
from hstap.train.config import TrainConfig

if TYPE_CHECKING:
    from hstap.drafter import Eagle3Drafter

# what a training run writes into OUT (hstap.train.trainer, checkpoint, tblog, plots): what --overwrite deletes
RUN_FILES = ("checkpoint", ".checkpoint.tmp", ".checkpoint.old", "metrics.jsonl", "metrics.jsonl.tmp", "tb",
             "config.json", "model.safetensors", "model.safetensors.tmp", "checksum.json", "checksum.json.tmp",
             "train_config.json", "train_config.json.tmp", "loss.png", "accuracy.png", "tau_estimate.png")


RUN_MARKS = ("train_config.json", "metrics.jsonl", "checkpoint", ".checkpoint.tmp")  # only a run writes these


def preflight(cfg: TrainConfig) -> None:
    """Every check that needs no model, data or process group: a bad flag fails in a second, not after loading."""
    from hstap.capture.layers import parse_layers
    from hstap.models.target import model_config

    if cfg.online and cfg.store is not None:
        raise HstapError("pass either --store DIR (offline) or --online, not both")
    if not cfg.online and cfg.store is None:
        raise HstapError("nothing to train on: pass --store DIR (a capture) or --online --data ...")
    if not cfg.online and cfg.loops != "keep":
        raise HstapError(f"--loops {cfg.loops} is for --online; a store keeps what its capture rendered "
                         "(hstap capture --loops cut)")
    if not cfg.online and cfg.online_dtype != "bf16":
        raise HstapError(f"--online-dtype {cfg.online_dtype} is for --online; a store's states are what its capture "
                         "wrote (hstap capture --dtype fp8)")
    if cfg.online:
        check_loss_on(cfg.loss_on, cfg.loops, "--loops cut")
    if cfg.cuda_graphs and cfg.grad_reduce == "overlap":
        raise HstapError("--cuda-graphs with --grad-reduce overlap: a backward replayed from a CUDA graph runs no "
                         "DDP hooks; use --grad-reduce after (auto picks it)")
    if cfg.grad_reduce_dtype == "bf16" and not cfg.reduce_after and not cfg.device.startswith("cuda"):
        raise HstapError(f"--grad-reduce-dtype bf16 with DDP's overlapped all-reduce needs NCCL (PyTorch's bf16 hook), "
                         f"not --device {cfg.device}: add --grad-reduce after")
    check_device(cfg.device)
    if cfg.cuda_graphs and not cfg.device.startswith("cuda"):
        raise HstapError(f"--cuda-graphs replays CUDA graphs: it needs --device cuda, not {cfg.device}")
    if cfg.ttt_attention in ("flex", "flexdiag", "cudnn") and not cfg.device.startswith("cuda"):
        raise HstapError(f"--ttt-attention {cfg.ttt_attention} trains on CUDA only (its kernels have no CPU "
                         f"backward): use auto, math or flash with --device {cfg.device}")
    check_out_dir(cfg.out)
    check_run_dir(Path(cfg.out), cfg.resume, cfg.overwrite)
    layers = int(model_config(cfg.model)["num_hidden_layers"])  # names a missing model directory now
    if cfg.online:
        parse_layers(cfg.layers, layers)


def check_loss_on(loss_on: str, loops: str, where: str) -> None:
    """`--loops cut` takes loop tails out of the loss mask; `--loss-on all` would count them again."""
    if loss_on == "all" and loops == "cut":
        raise HstapError(f"--loss-on all would count the loop tails that {where} took out of the loss: train with "
                         "--loss-on answers, or on answers whose loops are kept (--loops keep)")


def check_run_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """A run directory is continued (`resume`), replaced (`overwrite`) or new; never silently written over."""
    if resume and overwrite:
        raise HstapError("--resume continues the run in --out, --overwrite deletes it: pass one of them")
    if resume:
        if not checkpoint.exists(out):
            raise HstapError(f"--resume: no checkpoint in {out / checkpoint.CKPT} (the run stopped before its first "
                             "one, or this is not a run directory): start afresh with --overwrite")
        return
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    shown = ", ".join(held[:4]) + (f", … ({len(held)} entries)" if len(held) > 4 else "")
    if held and not overwrite:
        raise HstapError(f"--out {out} is not empty ({shown}): pass --resume to continue its run from the "
                         "checkpoint, --overwrite to start afresh, or choose another --out")
    # --overwrite deletes config.json and model.safetensors: never those of a model directory named by mistake
    if held and not set(held) & set(RUN_MARKS):
        raise HstapError(f"--overwrite: --out {out} holds no training run ({shown}; none of "
                         f"{', '.join(RUN_MARKS)}): choose another --out")


def clear_run(out: Path) -> None:
    """Delete the files a training run writes (rank 0, `--overwrite`); anything else in `out` stays."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


class EarlyFailureCleanup:
    """A fresh run that fails (an error, a signal, a NaN) before its first checkpoint removes the run files it wrote
    (config.json, train_config.json, metrics.jsonl, tb/) and the `--out` directory it made: nothing of a run that
    trained no kept step is worth keeping, and left behind they would make the corrected command refuse `--out`
    ("not empty"). Files it did not write stay: `wrote` is set by the run just before it writes (rank 0).

        with EarlyFailureCleanup(out, fresh=not cfg.resume) as cleanup:
            ...
            cleanup.wrote = True
            (out / "train_config.json").write_text(...)
    """

    def __init__(self, out: Path, fresh: bool) -> None:
        self.out, self.fresh, self.wrote = Path(out), fresh, False
        self.made = not self.out.exists()

    def __enter__(self) -> EarlyFailureCleanup:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None or not (self.fresh and self.wrote) or checkpoint.exists(self.out):
            return
        clear_run(self.out)
        if self.made and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()


class CheckpointClock:
    """Whether a checkpoint is due after a step: `interval_s` of wall time since the last one (or the start),
    or every `every` steps when set."""

    def __init__(self, every: int | None, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.every, self.interval_s, self.clock = every, interval_s, clock
        self.last = clock()

    def due(self, step: int) -> bool:
        return self.by_steps(step) or self.by_time()

    def by_steps(self, step: int) -> bool:
        """Every `every` steps: the same answer on every rank, no collective needed."""
        return self.every is not None and step % self.every == 0

    def by_time(self) -> bool:
        """`interval_s` since the last checkpoint: ranks' clocks differ, so several ranks vote on it."""
        return self.clock() - self.last >= self.interval_s

    def saved(self) -> None:
        self.last = self.clock()


def save_final(drafter: Eagle3Drafter, out: Path, step: int) -> str | None:
    """Write the drafter's weights and the plots; on a full disk, the one-line error to raise on every rank (the
    final checkpoint is in place: `--resume` writes them again without training)."""
    from safetensors import SafetensorError

    from hstap.train.plots import plot_metrics

    try:
        drafter.save_pretrained(out, step=step)  # the step marks it as the finished run's (resume.drafter_written_at)
        plot_metrics(out / "metrics.jsonl", out)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as SafetensorError
        why = getattr(exc, "strerror", None) or str(exc)
        return (f"{out}: {why} while writing the trained drafter; the checkpoint of step {step} is in place: free "
                "space, then run the same command with --resume")
    return None
