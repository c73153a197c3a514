"""Progress that reads well where it lands: a bar redrawn in place on a terminal, plain lines in a log.

    bar = progress_bar(total=len(todo), desc="synth", unit="conv", disable=not progress)
    for conv in todo:
        ...
        bar.update(1)
    bar.close()

A tqdm bar redraws itself with a carriage return up to ten times a second. On a terminal that is one line that
moves; written to a file (a scheduler's log, `nohup`, `2> capture.log`) every redraw stays, and an hour of
capture leaves thousands of redraws on one "line" that a log viewer shows as a wall or not at all. So when the
stream is not a terminal the bar is a `LineProgress`: one plain line every EVERY_S seconds and one when it closes,
each ending in a newline, none rewritten:

    synth: 312/1000 conv (31%), 02:10 elapsed, 2.40 conv/s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Callable, TextIO

from tqdm import tqdm

EVERY_S = 10.0  # seconds between two lines in a log: a long run's log stays readable, a stalled one shows it


def progress_bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str, unit: str = "it",
                 unit_scale: bool = False, initial: int = 0, leave: bool = True, disable: bool = False,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 every_s: float = EVERY_S) -> tqdm | LineProgress:
    """A tqdm bar on a terminal (or when `disable`d: tqdm's own no-op), a LineProgress anywhere else. `stream`:
    where it writes, sys.stderr (tqdm's default) unless given; `clock` and `every_s` set a LineProgress's cadence."""
    stream = stream if stream is not None else sys.stderr
    if disable or _is_terminal(stream):
        return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial, leave=leave,
                    disable=disable, file=stream)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial,
                        stream=stream, clock=clock, every_s=every_s)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream: not a terminal either way
        return False


class LineProgress:
    """The part of tqdm's interface hstap uses (update, set_postfix, total, refresh, close, iteration, `with`),
    written as whole lines at most every `every_s` seconds by `clock`, plus a last one on close."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None, desc: str, unit: str,
                 unit_scale: bool, initial: int, stream: TextIO, clock: Callable[[], float], every_s: float):
        self.iterable, self.total, self.desc, self.unit, self.unit_scale = iterable, total, desc, unit, unit_scale
        self.n, self.initial, self.postfix = initial, initial, ""
        self.stream, self.clock, self.every_s = stream, clock, every_s
        self.started = self.last_line = clock()
        self.closed = False

    def __iter__(self) -> Iterator:
        assert self.iterable is not None, "LineProgress iterated without an iterable"
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            self._write(now)

    def set_postfix(self, **values) -> None:
        """Shown at the end of the next line, as tqdm shows it after its bar."""
        self.postfix = ", ".join(f"{name}={value}" for name, value in values.items())

    def refresh(self) -> None:
        """Nothing to redraw: the next line shows a changed total."""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._write(self.clock())

    def line(self, now: float) -> str:
        """`desc: n/total unit (p%), elapsed, rate[, postfix]`, numbers scaled (12.3k) when `unit_scale`."""
        elapsed = now - self.started
        done = self._count(self.n)
        if self.total:
            done += f"/{self._count(self.total)} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            done += f" {self.unit}"
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {done}", f"{tqdm.format_interval(elapsed)} elapsed",
                 f"{self._count(rate, exact=False)} {self.unit}/s"]
        return ", ".join(parts + ([self.postfix] if self.postfix else []))

    def _count(self, value: float, exact: bool = True) -> str:
        if self.unit_scale:
            return tqdm.format_sizeof(value)
        return f"{value:.0f}" if exact or value >= 10 else f"{value:.2f}"

    def _write(self, now: float) -> None:
        self.stream.write(self.line(now) + "\n")
        self.stream.flush()
