"""Gradients averaged over ranks by one all-reduce after the step's backward: what a step replayed from a CUDA
graph needs under torchrun.

DDP averages gradients from autograd hooks: buckets are all-reduced while the backward still runs, so most of the
traffic hides behind it. A backward replayed from a CUDA graph runs no hooks (the graph replays kernels, not
Python), which is why `hstap train --cuda-graphs` was one process only. Here every trainable parameter's `.grad`
is a view into one flat buffer per dtype and device: the graphs, and an eager backward's in-place accumulation,
add into it; after the step's last batch a single all-reduce sums it and one scale divides by the ranks. Nothing
of it overlaps the backward; the price is the gradients' bytes over the link once a step (the 8B drafter: 424 M
fp32 gradients, 1.7 GB). Over NVLink that is a small part of a replayed step, and less than the host launches
the eager step it replaces spends (docs/distributed.md).

    flat = FlatGradients(params, dist)       # before the optimizer's first step and before any graph capture
    ... backward(s) of this step ...
    flat.average()                           # then clip, optimizer.step(), optimizer.zero_grad(set_to_none=False)

The optimizer must zero the gradients in place (`set_to_none=False`): a gradient set to None is a view lost.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from hstap.train.distributed import Dist


class FlatGradients:
    """The gradients of `params` as views into one flat buffer per (dtype, device), averaged over `dist`'s ranks by
    one all-reduce each. Like DDP at wrap time, it first gives every rank rank 0's parameters. `reduce_dtype`
    (bf16): the buffer crosses the link in that dtype, half the bytes of fp32, each averaged gradient rounded to
    it once, as DDP's bf16 compression hook does (one cast in, one cast back: two passes over bytes that cross
    the link in half the time)."""

    def __init__(self, params: list[nn.Parameter], dist: Dist, reduce_dtype: torch.dtype | None = None):
        self.params, self.dist, self.reduce_dtype = list(params), dist, reduce_dtype
        self._low: dict[int, torch.Tensor] = {}  # per buffer, its reduce_dtype copy (made once)
        if dist.enabled:
            with torch.no_grad():
                for p in self.params:
                    tdist.broadcast(p, src=0)
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.buffers: list[tuple[torch.Tensor, list[tuple[nn.Parameter, int]]]] = []
        for (dtype, device), members in groups.items():
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
            offsets, at = [], 0
            for p in members:
                offsets.append((p, at))
                at += p.numel()
            self.buffers.append((flat, offsets))
        self.attach()

    def attach(self) -> None:
        """Point every parameter's `.grad` at its place in the flat buffer, keeping what it held. Autograd adds into
        an existing gradient in place, so the views hold from step to step (checked by address: a few host
        microseconds); one replaced anyway (set to None, or assigned) is put back here, its values kept."""
        for flat, offsets in self.buffers:
            for p, at in offsets:
                where = flat.data_ptr() + at * flat.element_size()
                if p.grad is not None and p.grad.data_ptr() == where and p.grad.is_contiguous():
                    continue
                view = flat[at:at + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def average(self) -> None:
        """Every rank's gradients averaged: each rank then holds the mean, as after DDP's backward. On NCCL the host
        does not wait for it."""
        self.attach()
        if not self.dist.enabled:
            return
        for i, (flat, _) in enumerate(self.buffers):
            wire = flat
            if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
                wire = self._low.setdefault(i, torch.empty_like(flat, dtype=self.reduce_dtype))
                wire.copy_(flat)
            if tdist.get_backend() == "nccl":  # NCCL divides inside the all-reduce: no second pass over 1.7 GB
                tdist.all_reduce(wire, op=tdist.ReduceOp.AVG)
            else:  # gloo has no AVG
                tdist.all_reduce(wire, op=tdist.ReduceOp.SUM)
                wire.mul_(1.0 / self.dist.world_size)
            if wire is not flat:
                flat.copy_(wire)
