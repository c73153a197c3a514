"""One process or `torchrun`: the same code. Under torchrun (WORLD_SIZE > 1) the drafter is wrapped in DDP —
NCCL on GPUs, gloo on CPUs — and every rank trains on its own slice of the batch plan."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def wrap(self, module: nn.Module) -> nn.Module:
        if not self.enabled:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=ids)

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def no_sync(self, model: nn.Module, last: bool):
        """DDP's gradient all-reduce only on the last batch of an accumulated step."""
        if self.enabled and not last:
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


def setup(device: str) -> Dist:
    """Join the process group torchrun set up, if any; pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(0, 1, torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = device.startswith("cuda")
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if on_gpu else "gloo")
    dev = torch.device(f"cuda:{local}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    return Dist(rank, world, dev)
