"""The engine's keeper: the process `hstap serve` starts, so that the engine dies with its supervisor.

    python -m hstap.serve.keeper LIFELINE_FD GRACE_S -- ENGINE ARGV...

The supervisor holds the write end of a pipe whose read end (LIFELINE_FD) only the keeper has. However the
supervisor ends — Ctrl-C, SIGTERM, `kill -9`, the OOM killer — the kernel closes its end, the keeper's read returns
EOF, and the keeper stops the engine: SIGTERM to the process group and to every descendant (those that left the
group too), SIGKILL after GRACE_S. It is the group's child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so a
descendant whose parent exits is re-parented to the keeper instead of init and is still found; the engine itself
gets `PR_SET_PDEATHSIG` (SIGKILL), so it cannot outlive a keeper that was killed outright.

While the supervisor lives the keeper only waits. When the engine exits, the keeper stops what the engine left
behind and exits with the engine's own status (a death by signal is re-raised), so the supervisor reports the
engine's exit code. Stdlib and psutil only: it starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

import psutil

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> None:
    """prctl(2) through libc; a no-op where there is none (not Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _die_with_keeper() -> None:
    """preexec_fn of the engine: SIGKILL when the keeper dies, however it dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _tree() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _reap(engine: subprocess.Popen) -> None:
    """Collect re-parented descendants that exited (the engine itself is left to Popen, for its exit code)."""
    for child in _tree():
        if child.pid != engine.pid:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass


def _signal_tree(sig: int, seen: dict[int, psutil.Process]) -> None:
    try:
        os.killpg(os.getpgrp(), sig)  # the keeper's own handler ignores it
    except OSError:
        pass
    for p in seen.values():  # descendants that moved to a group of their own
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def stop_tree(engine: subprocess.Popen, seen: dict[int, psutil.Process], grace_s: float) -> None:
    """SIGTERM every descendant, SIGKILL what is left after `grace_s`, reap them all."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        seen.update((p.pid, p) for p in _tree())
        _signal_tree(sig, seen)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            engine.poll()
            _reap(engine)
            if not [p for p in seen.values() if _running(p)]:
                return
            time.sleep(0.05)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exit_like(code: int) -> None:
    if code < 0:  # killed by a signal: die of the same one, so the supervisor sees what the engine saw
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m hstap.serve.keeper LIFELINE_FD GRACE_S -- ENGINE ARGV...")
    lifeline, grace_s, engine_argv = int(argv[0]), float(argv[1]), argv[3:]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # the group gets them too: the engine's exit is what ends the keeper
    from hstap.serve.stacks import enable_stack_dumps

    enable_stack_dumps()
    engine = subprocess.Popen(engine_argv, preexec_fn=_die_with_keeper)  # stdout: the supervisor's log pipe
    seen: dict[int, psutil.Process] = {}
    while True:
        seen.update((p.pid, p) for p in _tree())
        code = engine.poll()
        if code is not None:
            stop_tree(engine, {pid: p for pid, p in seen.items() if pid != engine.pid}, grace_s)
            _exit_like(code)
        readable, _, _ = select.select([lifeline], [], [], 0.5)
        if readable and not os.read(lifeline, 1):  # EOF: the supervisor is gone
            stop_tree(engine, seen, grace_s)
            _exit_like(engine.poll() if engine.poll() is not None else -signal.SIGKILL)
        _reap(engine)


if __name__ == "__main__":
    main()
