"""Run a function over static buffers eagerly, or capture it once as a CUDA graph and replay it; time stages.

    step = Graphed(lambda: body(slot), capture=on_cuda, pool=pool, state=[slot.write_at])
    step()                                   # replay (CUDA) or call (CPU): one API for both paths

A body reads and writes only tensors allocated outside it (the slot's buffers), so a replay sees the values the
host (or a previous graph) left there; anything one graph hands to another goes through such a buffer, which is
why several graphs can share one memory pool. Capturing first runs the body for real on a side stream (lazy
initialisations, cuBLAS workspaces, SDPA's kernel choice); `state` lists the tensors that run would change and
that must read as before afterwards (write positions, roots): they are saved and restored around the capture.

A replay pays for every kernel its body launched, so a body's small functions can run compiled (`InCapture`:
torch.compile with fixed shapes — a body's shapes never change — inside `with graph_body():`, eager elsewhere).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from hstap.errors import first_line

COMPILE_BACKEND = "inductor"  # tests compile on a CPU with "aot_eager"
RECOMPILE_LIMIT = 64
_in_body = [False]


@contextmanager
def graph_body() -> Iterator[None]:
    """The code a CUDA graph captures (its warm-up runs and the capture): `InCapture` functions run compiled."""
    outer, _in_body[0] = _in_body[0], True
    try:
        yield
    finally:
        _in_body[0] = outer


class InCapture:
    """`fn` through torch.compile (dynamic=False) inside `graph_body()`, plain `fn` outside it (prefill, sampled
    cycles: shapes that change every call). It compiles once per shape, during a capture's warm-up; a compile
    that fails turns it off for good, with one line on stderr naming `what`, and `fn` runs instead."""

    def __init__(self, fn: Callable, fused: bool, what: str):
        self.fn, self.what, self.failure = fn, what, ""
        self.compiled = torch.compile(fn, dynamic=False, backend=COMPILE_BACKEND) if fused else None
        if fused:  # one compile per (shape, decoder): an evaluation's shapes would pass dynamo's default of 8 per
            # function and silently run eager after that
            limits = torch._dynamo.config
            limits.recompile_limit = max(limits.recompile_limit, RECOMPILE_LIMIT)

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # inside a larger compiled body: let its trace inline the plain function
            return self.fn(*args)
        if _in_body[0] and self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 — a compiler failure must not end a decode: say so, go eager
                self.failure = first_line(e)[:300]
                self.compiled = None
                print(f"hstap: {self.what} failed to compile ({self.failure}); continuing eagerly", file=sys.stderr)
        return self.fn(*args)


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
