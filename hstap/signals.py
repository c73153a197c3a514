"""SIGINT/SIGTERM that stop a long command between units of work instead of inside one (capture's batches,
training's steps): before `defer()` a signal raises `Interrupted` at once (nothing is at stake yet); after it the
first signal is only recorded in `signum` and announced on stderr, and the command checks it at its next boundary;
a second signal raises at once. Schedulers, containers and `timeout` send SIGTERM; it is handled exactly like
Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import threading

from hstap.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredStop:
    """Installs the handlers for the duration of a `with` (main thread only; elsewhere a no-op). Subclasses name
    the command and what it does once signalled (`command`, `notice`)."""

    command = "hstap"
    notice = "stopping"

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._deferring = False
        self._old: dict[int, object] = {}

    def __enter__(self):
        if self.enabled:
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def defer(self) -> None:
        """From now on the first signal is only recorded: the caller stops at its next check."""
        self._deferring = True

    def _handle(self, signum: int, frame) -> None:
        if self._deferring and self.signum is None:
            self.signum = signum
            name = signal.Signals(signum).name
            os.write(2, f"\n{self.command}: {name}: {self.notice} ({name} again to stop at once)\n".encode())
            return
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}")
