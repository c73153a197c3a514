"""A training step's numbers, logged one step late so the host never waits on the device for them.

    pending = StepLog(log.write, bar)
    pending.hold({"kind": "train", "step": 7, ...}, loss, grad_norm, step_losses)   # queued, not read
    ...                                     # the next step queued on the device
    pending.hold(...)                       # step 7's numbers read (done by now) and written; step 8's queued
    pending.flush()                         # before a checkpoint, an evaluation, the end

Reading a loss back (`float(loss)`) waits for every kernel queued before it. Done each step, the GPU then idles
while the host turns to the next step: its Python, the next batch's copy, the launches until the first kernel
runs. A step replayed from a CUDA graph costs the host so little that this idle time is a visible part of it.
Here the numbers are copied to pinned host memory on the device's own queue, an event marks the copy, and they
are read once the next step is queued behind them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


class NonFiniteStep(Exception):
    """A step's loss or gradient norm came back NaN or inf (raised by `StepLog.flush` before its record is written:
    a run stops there, keeping its last checkpoint, instead of training on, and checkpointing, NaN weights)."""

    def __init__(self, record: dict, loss: float, grad_norm: float) -> None:
        super().__init__(f"step {record.get('step')}: loss {loss}, gradient norm {grad_norm}")
        self.step, self.loss, self.grad_norm = record.get("step"), loss, grad_norm


def copy_out(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`t` copied to pinned host memory on the device's queue, with the event that marks the copy done (None off
    CUDA, where `t` itself is returned): read it once `event.synchronize()` returns, a step later."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class StepLog:
    """Holds one step's record until the next step is queued (see the module)."""

    def __init__(self, write: Callable[[dict], None], bar=None):
        self.write = write
        self.bar = bar  # a progress bar (hstap.progress) whose postfix shows the last written loss
        self._held: tuple[dict, torch.Tensor, torch.cuda.Event | None] | None = None

    def hold(self, record: dict, loss: torch.Tensor, grad_norm: torch.Tensor, step_losses: torch.Tensor) -> None:
        """Queue the copy of this step's numbers; write the step held before (its numbers are computed by now)."""
        self.flush()
        numbers = torch.cat([loss.detach().float().view(1), grad_norm.detach().float().view(1),
                             step_losses.detach().float().view(-1)])  # (2 + TTT steps,), on the device's queue
        self._held = (record, *copy_out(numbers))

    def flush(self) -> None:
        """Write the held step, waiting for its numbers if they are not back yet; NonFiniteStep instead when its
        loss or gradient norm is NaN or inf (every checkpoint is preceded by a flush, so none holds such a step)."""
        if self._held is None:
            return
        record, host, ready = self._held
        self._held = None
        if ready is not None:
            ready.synchronize()
        loss, grad_norm, *step_losses = host.tolist()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteStep(record, loss, grad_norm)
        self.write({**record, "loss": loss, "step_losses": step_losses, "grad_norm": grad_norm})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}")
