"""One process or `torchrun`: the same code. Under torchrun (WORLD_SIZE > 1) the drafter is wrapped in DDP —
NCCL on GPUs, gloo on CPUs — and every rank trains on its own slice of the batch plan."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch import nn

from hstap.errors import HstapError
from hstap.train.steplog import copy_out


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def wrap(self, module: nn.Module, bf16_gradients: bool = False) -> nn.Module:
        """DDP around `module` (several ranks); `bf16_gradients`: its buckets all-reduced in bf16 (PyTorch's
        compression hook, which PyTorch allows on NCCL only), half the bytes."""
        if not self.enabled:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(module, device_ids=ids)
        if bf16_gradients:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def no_sync(self, model: nn.Module, last: bool):
        """DDP's gradient all-reduce only on the last batch of an accumulated step (a model not wrapped in DDP has
        none to skip)."""
        if self.enabled and not last and isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def mean_on_device(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor averaged over ranks where it lives: on NCCL the host does not wait for it."""
        if not self.enabled:
            return value
        value = value.clone()
        tdist.all_reduce(value, op=tdist.ReduceOp.SUM)
        return value / self.world_size

    def _reduce(self, value: float, op) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=op)
        return float(t)

    def agree_max(self, value: float) -> float:
        """The largest `value` over ranks: a decision every rank must take identically (e.g. when to stop)."""
        return self._reduce(value, tdist.ReduceOp.MAX)


class LateVote:
    """Whether any rank voted yes, learned one call late so the host never waits on the device for the answer.

    A decision every rank must take together (a checkpoint whose clock runs out on one rank first) needs a
    collective, and reading its answer back at once waits for everything queued on the device before it: the
    whole step, every step, leaving the GPU idle while the host turns to the next one. Here a call queues this
    step's vote (an all-reduce of a device scalar, no host copy in) and returns the answer of the call before,
    copied out behind an event and done by now. Every rank makes the same calls, so every rank gets the same
    answer at the same step. One process: the vote itself, at once.

    A vote may be a small int instead of a bool (hstap.train.stop: 1 a checkpoint is due, 2 a rank was signalled
    to stop): the answer is the largest of every rank's."""

    def __init__(self, dist: Dist):
        self.dist = dist
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def __call__(self, yes: bool | int) -> int:
        if not self.dist.enabled:
            return int(yes)
        earlier = self._take()
        vote = torch.full((1,), float(yes), device=self.dist.device)
        tdist.all_reduce(vote, op=tdist.ReduceOp.MAX)
        self._pending = copy_out(vote)
        return earlier

    def _take(self) -> int:
        if self._pending is None:
            return 0
        vote, ready = self._pending
        self._pending = None
        if ready is not None:
            ready.synchronize()
        return int(vote[0])

    def clear(self) -> None:
        """Drop the vote in flight (after acting on a yes: the vote queued beside it predates the action). Every
        rank clears at the same step, since every rank acted on the same answer."""
        self._pending = None


def dist_timeout_s() -> float:
    """Seconds a collective may wait before the process group aborts the run: $HSTAP_DIST_TIMEOUT_S, else 1,800."""
    raw = os.environ.get("HSTAP_DIST_TIMEOUT_S", "1800")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise HstapError(f"HSTAP_DIST_TIMEOUT_S={raw!r}: expected a positive number of seconds")
    return seconds


def setup(device: str) -> Dist:
    """Join the process group torchrun set up, if any; pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        one = torch.device(device)
        if one.type == "cuda" and one.index is None:  # tensors there say cuda:0, and cuda:0 != cuda: a check for
            one = torch.device("cuda", 0)  # "already on the device" would copy (teacher_head: 1 GB at 8B)
        return Dist(0, 1, one)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = device.startswith("cuda")
    if not tdist.is_initialized():  # rank 0 alone evaluates the held-out set while the others wait in a collective:
        # NCCL's default 10-minute timeout would abort a run whose evaluation takes longer (gloo's is 30)
        tdist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=dist_timeout_s()))
    dev = torch.device(f"cuda:{local}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    return Dist(rank, world, dev)
