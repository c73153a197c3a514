"""Run a function over static buffers eagerly, or capture it once as a CUDA graph and replay it; time stages.

    step = Graphed(lambda: body(slot), capture=on_cuda, pool=pool, state=[slot.write_at])
    step()                                   # replay (CUDA) or call (CPU): one API for both paths

A body reads and writes only tensors allocated outside it (the slot's buffers), so a replay sees the values the
host (or a previous graph) left there; anything one graph hands to another goes through such a buffer, which is
why several graphs can share one memory pool. Capturing first runs the body for real on a side stream (lazy
initialisations, cuBLAS workspaces, SDPA's kernel choice); `state` lists the tensors that run would change and
that must read as before afterwards (write positions, roots): they are saved and restored around the capture.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class Graphed:
    """`body` run directly (capture=False) or replayed from a CUDA graph captured at construction.

    `rehearse` (no CUDA needed) runs the capture's warm-up and state restore without capturing: a CPU test of
    the graph path's bookkeeping (a body that changes state it does not declare shows up as wrong output)."""

    def __init__(self, body: Callable[[], None], capture: bool, pool=None, state: list[torch.Tensor] = (),
                 warmup: int = 2, rehearse: bool = False):
        self.body = body
        self.graph: torch.cuda.CUDAGraph | None = None
        if not (capture or rehearse):
            return
        saved = [t.clone() for t in state]
        if capture:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    body()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                body()
        else:
            for _ in range(warmup):
                body()
        for t, s in zip(state, saved):
            t.copy_(s)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


class StageClock:
    """Seconds spent per named stage without a host sync per stage: CUDA events on a GPU (read once, at
    `totals`), wall time on a CPU (where every op is synchronous anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.seconds: dict[str, float] = {}

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append(("", self._now()))

    def lap(self, stage: str) -> None:
        """The time since the previous mark counts for `stage`."""
        self.marks.append((stage, self._now()))

    def totals(self) -> dict[str, float]:
        """Seconds per stage (synchronises once on a GPU)."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        for (_, before), (stage, after) in zip(self.marks, self.marks[1:]):
            if stage:
                spent = before.elapsed_time(after) / 1000 if self.cuda else after - before
                self.seconds[stage] = self.seconds.get(stage, 0.0) + spent
        self.marks = self.marks[-1:]
        return dict(self.seconds)
