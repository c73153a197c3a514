"""Live engines: real vLLM and SGLang servers, started by `hstap serve` from their own virtual environments.

`make test` builds the engines' environments (`.venv-vllm`, `.venv-sglang`, see engines/) before the suite runs;
a missing environment fails these tests (it is a broken set-up, not an absent feature). `HSTAP_VLLM_PYTHON` and
`HSTAP_SGLANG_PYTHON` point at another environment's interpreter.

Every server listens on a free port of 127.0.0.1 and is stopped (and checked gone, its whole process tree) before
its fixture returns.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from hstap.serve.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"vllm": ROOT / ".venv-vllm", "sglang": ROOT / ".venv-sglang"}
CONVERSATIONS, MAX_TOKENS = 8, 256  # what each engine's capture takes from ShareGPT (most are cut at 256 tokens)


def engine_python(engine: str) -> Path:
    """The interpreter of `engine`'s own environment; fails (never skips) when `make test` did not build it."""
    python = Path(os.environ.get(f"HSTAP_{engine.upper()}_PYTHON", VENVS[engine] / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"{python} is missing: `make test` builds the {engine} environment (engines/{engine}.sh)")
    return python


def hstap(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """An hstap command in a subprocess of hstap's own environment (output captured)."""
    return subprocess.run([sys.executable, "-m", "hstap.cli", *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=timeout)


@dataclass
class Served:
    """A running `hstap serve`: its URL, its output so far, and the pids it ever started."""

    url: str
    proc: subprocess.Popen
    run_dir: Path
    lines: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)

    def output(self) -> str:
        return "\n".join(self.lines)


def _tee(proc: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if " ready on http" in line and "hstap serve:" in line:
            ready.set()
    ready.set()  # ended: let the waiter look at the exit code


def _tree(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.Error:
        return set()


def alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


@contextmanager
def hstap_serve(engine: str, run_dir: Path, *args: str, env: dict[str, str] | None = None,
                ready_timeout: float = 420, stop_with: int = signal.SIGINT) -> Iterator[Served]:
    """Start `hstap serve --engine ENGINE --engine-python <its venv> ...ARGS` on a free port; yield once it says
    ready; on exit send `stop_with` to hstap serve (SIGINT: Ctrl-C; SIGKILL: serve dies at once and its keeper must
    stop the engine), wait, and assert that no process of its tree survives."""
    port = free_port()
    cmd = [sys.executable, "-m", "hstap.cli", "serve", "--engine", engine, "--port", str(port),
           "--engine-python", str(engine_python(engine)), "--run-dir", str(run_dir), "--grace", "5", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    served = Served(f"http://127.0.0.1:{port}", proc, run_dir)
    ready = threading.Event()
    threading.Thread(target=_tee, args=(proc, served.lines, ready), daemon=True).start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(1):
            served.pids |= _tree(proc.pid)
            if time.monotonic() > deadline:
                raise AssertionError(f"{engine} not ready in {ready_timeout} s:\n" + served.output()[-4000:])
        served.pids |= _tree(proc.pid)
        if proc.poll() is not None:
            raise AssertionError(f"hstap serve exited {proc.returncode} before ready:\n" + served.output()[-4000:])
        yield served
    finally:
        served.pids |= _tree(proc.pid)
        if proc.poll() is None:
            proc.send_signal(stop_with)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        deadline = time.monotonic() + 60  # after a SIGKILL the keeper stops the group on its own
        while alive(served.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = alive(served.pids)
        for pid in survivors:  # never leave an engine behind, even when the assertion below fails the test
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not survivors, f"engine processes survived hstap serve: {survivors}"


@pytest.fixture(scope="session")
def transformers_capture(tmp_path_factory) -> Path:
    """`hstap capture` (transformers, fp32 on the CPU, teacher `hidden`) of the CONVERSATIONS first ShareGPT
    conversations at MAX_TOKENS: the store each engine's capture is compared with, made once per run (the engines'
    files run on different xdist workers)."""
    from tests.conftest import shared_dir

    def build(out: Path) -> None:
        t0 = time.monotonic()
        made = hstap("capture", "--data", "sharegpt", "--limit", str(CONVERSATIONS), "--max-tokens", str(MAX_TOKENS),
                     "--teacher", "hidden", "--out", str(out))
        assert made.returncode == 0, made.stdout + made.stderr
        print(f"\nhstap capture (transformers): {time.monotonic() - t0:.1f} s")

    return shared_dir(tmp_path_factory, "transformers-capture", build)


def engine_processes(served: Served) -> list[psutil.Process]:
    """The engine's processes: everything below the keeper (hstap serve's one child), the keeper excluded."""
    return [p for keeper in psutil.Process(served.proc.pid).children() for p in keeper.children(recursive=True)]


@dataclass
class Hang:
    stopped: list[psutil.Process]  # the engine processes SIGSTOPped
    seconds: float  # from the SIGSTOP to hstap serve's exit
    output: str  # hstap serve's whole output
    client_errors: list[str]  # what the request in flight raised


def hang_mid_request(served: Served, running: Callable[[], bool], health_timeout: int) -> Hang:
    """Send a long generation, wait until `running()` says the engine works on it, then SIGSTOP every engine
    process: `hstap serve` must find /health unanswered for `health_timeout` s, report a HANG during ready and exit 1
    (its fixture then checks that no process is left). Ends the server: a module's last test."""
    failed: list[str] = []

    def generate() -> None:
        try:
            httpx.post(f"{served.url}/v1/completions", timeout=health_timeout + 120,
                       json={"prompt": "Count to one thousand:", "max_tokens": 1500, "ignore_eos": True})
        except httpx.HTTPError as exc:
            failed.append(type(exc).__name__)

    client = threading.Thread(target=generate, daemon=True)
    client.start()
    deadline = time.monotonic() + 120
    while not running():
        assert time.monotonic() < deadline and client.is_alive(), "the generation never showed as running"
        time.sleep(0.2)
    stopped = engine_processes(served)
    for p in stopped:
        p.send_signal(signal.SIGSTOP)
    at = time.monotonic()
    assert served.proc.wait(timeout=health_timeout + 90) == 1, served.output()[-3000:]
    hang = Hang(stopped, time.monotonic() - at, "", failed)
    client.join(timeout=30)
    hang.output = served.output()
    print(f"\nSIGSTOP of {len(stopped)} engine processes mid-request: serve exited {hang.seconds:.1f} s later")
    assert re.search(r"hstap serve: HANG during ready: GET /health unanswered for \d+ s while serving",
                     hang.output), hang.output[-3000:]
    # the limit + a probe interval + the probe's timeout + the stacks + the grace period
    assert hang.seconds <= health_timeout + 30, hang.output[-3000:]
    assert failed, "the request in flight must have failed"
    return hang
