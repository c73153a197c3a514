"""Python stacks of every process of a hung engine: py-spy from outside, else faulthandler from inside.

    paths = dump_stacks([pid, ...], run_dir / "stacks", run_dir / "faulthandler")   # RUN_DIR/stacks/<pid>.txt

py-spy (`py-spy dump --pid`) needs nothing from the engine, but it needs a py-spy binary and ptrace rights (a
container may lack them). hstap's own processes (the keeper and the `hf` engine) call `enable_stack_dumps()`
too: with HSTAP_FAULTHANDLER_DIR set (the supervisor sets it), they register faulthandler on SIGUSR2 writing into
DIR/<pid>.txt, so a signal gets their stacks where py-spy cannot. A process is sent SIGUSR2 only when it catches
that signal (SigCgt in /proc/PID/status): the default action would kill an engine that does not.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = "HSTAP_FAULTHANDLER_DIR"
DUMP_SIGNAL = signal.SIGUSR2
_files: list = []  # faulthandler writes into these for the life of the process


def enable_stack_dumps() -> None:
    """Dump every thread's stack into $HSTAP_FAULTHANDLER_DIR/<pid>.txt on SIGUSR2 (no-op when it is unset)."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        f = open(Path(folder) / f"{os.getpid()}.txt", "w")  # noqa: SIM115 — kept open on purpose
    except OSError:
        return
    _files.append(f)
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True)


def py_spy() -> str | None:
    """The py-spy next to this interpreter (the venv's), else on PATH, else None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: the SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^SigCgt:\s*([0-9a-fA-F]+)", status, re.M)
    return bool(m) and bool(int(m.group(1), 16) >> (sig - 1) & 1)


def _by_py_spy(spy: str, pid: int) -> tuple[str, str]:
    """(stacks, '') or ('', why not). py-spy pauses the process to read a consistent stack and fails on one that
    is already stopped (SIGSTOP: "Failed to suspend process"); such a process cannot move, so it is read again
    without pausing (`--nonblocking`)."""
    why = ""
    for extra in ([], ["--nonblocking"]):
        try:
            out = subprocess.run([spy, "dump", *extra, "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return "", f"py-spy failed: {exc}"
        if out.returncode == 0:
            return out.stdout, ""
        why = why or f"py-spy failed: {' '.join((out.stderr or out.stdout).split())[:200]}"
    return "", why


def _by_faulthandler(pid: int, folder: Path | None) -> str:
    """Signal `pid` and read what its faulthandler wrote ('' when it registered none)."""
    file = folder / f"{pid}.txt" if folder is not None else None
    if file is None or not file.exists() or not catches(pid, DUMP_SIGNAL):
        return ""
    before = file.stat().st_size
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return ""
    size, deadline = before, time.monotonic() + 3.0
    while time.monotonic() < deadline:  # the handler writes at once; wait until the file stops growing
        time.sleep(0.1)
        now = file.stat().st_size
        if now > before and now == size:
            break
        size = now
    with open(file, "rb") as f:
        f.seek(before)
        return f.read().decode(errors="replace")


def dump_stacks(pids: list[int], stacks: Path, faulthandler_dir: Path | None = None) -> dict[int, str]:
    """Write each process's Python stacks to `stacks/<pid>.txt` (py-spy, else faulthandler, else why neither);
    returns pid -> 'py-spy' | 'faulthandler' | ''."""
    stacks.mkdir(parents=True, exist_ok=True)
    spy, how = py_spy(), {}
    for pid in pids:
        text, why = _by_py_spy(spy, pid) if spy else ("", "py-spy is not installed")
        how[pid] = "py-spy" if text else ""
        if not text:
            text = _by_faulthandler(pid, faulthandler_dir)
            how[pid] = "faulthandler" if text else ""
        (stacks / f"{pid}.txt").write_text(text or f"no stacks: {why}, and the process registers no faulthandler "
                                                   f"on SIGUSR2\n")
    return how


def drop_empty(faulthandler_dir: Path) -> None:
    """Remove the dump files nobody wrote into (every run opens one per hstap process)."""
    for file in faulthandler_dir.glob("*.txt"):
        try:
            if file.stat().st_size == 0:
                file.unlink()
        except OSError:
            pass
    try:
        faulthandler_dir.rmdir()
    except OSError:
        pass
