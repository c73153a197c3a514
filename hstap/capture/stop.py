"""How `hstap capture` stops without losing work: on SIGTERM or SIGINT, and on a store that cannot commit.

    with StopSignals() as stop, StoreWriter(out, meta) as writer:
        sink = GuardedSink(writer)
        ...                                   # a signal here (model load) stops at once: nothing is buffered yet
        stop.defer()                          # from here a signal ends the loop at the next batch instead
        prefill_with_tap(..., sink, stop=lambda: stop.signum is not None or sink.error is not None)
    stop.raise_if_stopped(...)                # after the writer committed its buffer

Schedulers, containers and `timeout` send SIGTERM; it is handled exactly like Ctrl-C. Neither raises inside the
forward or the tap's hand-off: the loop ends after the batch in flight, the tap drains, the writer commits what it
buffered as a shard, and the command exits 130 (SIGINT) or 143 (SIGTERM). A second signal stops at once (the
committed shards are safe either way; only the buffer is at stake).

Under torchrun (a tensor-parallel target) every rank runs every forward, so the ranks must stop after the same
batch: a rank that stopped alone would leave the others waiting in the next forward's all-reduce. Before each
batch they agree (`StopSignals.agree`: one all-reduce of a stop code), so a signal to any rank — torchrun
forwards the scheduler's SIGTERM to all of them, at slightly different moments — and a failed commit on rank 0
stop all of them there.
"""

from __future__ import annotations

import signal

from hstap.errors import Interrupted
from hstap.faults import fault_point
from hstap.signals import SIGNALS, DeferredStop
from hstap.store.writer import StoreWriteError, StoreWriter

class StopSignals(DeferredStop):
    """SIGINT/SIGTERM handlers for the duration of a `with` (hstap.signals): once deferred, the loop ends after
    the batch in flight and the writer commits its buffer."""

    command = "hstap capture"
    notice = "stopping after this batch and committing what is buffered"

    def agree(self, failed: bool = False) -> bool:
        """Agree with the other ranks whether to stop before the next batch (`failed`: this rank's store cannot
        commit); a signal another rank received counts as received here, so every rank reports it alike."""
        code = agree(COMMIT_FAILED if failed else (self.signum or 0))
        if self.signum is None and code in SIGNALS:
            self.signum = code
        return code != 0

    def raise_if_stopped(self, message: str) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum, f"stopped by {signal.Signals(self.signum).name}: {message}")


COMMIT_FAILED = 255  # what rank 0 contributes to `agree` when its store cannot commit (above any signal number)


def agree(code: int) -> int:
    """The largest of every rank's stop code (a signal number, COMMIT_FAILED, 0 = go on): one MAX all-reduce
    under torch.distributed, else `code` itself. Every rank must call it at the same point of the loop."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return code
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([code], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


class GuardedSink:
    """The tap's sink: the first failed commit (a full disk) is kept to stop the capture at the next batch, instead
    of the tap counting one error per later sample; samples arriving after it are not stored (a resume captures
    them)."""

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.error: StoreWriteError | None = None

    def __call__(self, sample_id: str, tensors: dict) -> None:
        if self.error is not None:
            return
        try:
            self.writer.add(sample_id, tensors)
        except StoreWriteError as exc:
            self.error = exc
            raise

    def batch_done(self) -> None:
        """A whole batch is in the writer (the tap's writer thread calls it): commit now if `--commit-every` has
        passed since the last commit, so a kill loses at most that much completed work — not one batch more."""
        if self.error is not None:
            return
        try:
            self.writer.commit_if_due()
        except StoreWriteError as exc:
            self.error = exc
            raise
        fault_point("batch-stored")
