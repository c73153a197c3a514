"""`hstap serve` under faults: a port another server holds, the supervisor killed or signalled, the `hf` engine
hanging in each start-up phase (HSTAP_FAULT). Every test checks with psutil that no engine process is left.

The hangs in the `hf` engine's warm-up and first request need the model loaded first (~15 s on the 2-core test
machine, plus a stall timeout above the silent load): they run with HSTAP_RELIABILITY_LOOPS=1 only; the loading
hang runs in the suite. Detection times are recorded in docs/reliability.md (bench/serve_faults.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hstap.cli import main
from hstap.serve import stacks
from hstap.serve.config import ServeConfig
from hstap.serve.supervisor import Supervisor
from tests.capture.test_remote import _wait_healthy
from tests.serve.test_supervisor import FAKE, ROOT, _cleanup, _none_alive, _pids, _serve, free_port

LOOPS = os.environ.get("HSTAP_RELIABILITY_LOOPS") == "1"


def _foreign_server(tmp_path: Path, port: int) -> subprocess.Popen:
    """Another process's server on `port` that answers GET /health with 200 (the fake engine, run directly)."""
    server = subprocess.Popen([sys.executable, str(FAKE), "healthy", "--port", str(port)],
                              env={**os.environ, "FAKE_PIDS": str(tmp_path / "foreign-pids")},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_healthy(f"http://127.0.0.1:{port}")
    return server


def _stop(server: subprocess.Popen, tmp_path: Path) -> None:
    server.terminate()
    server.wait(timeout=30)
    _cleanup([int(x) for x in (tmp_path / "foreign-pids").read_text().split()])


def _gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of `pids` runs (exited, or a zombie nobody has reaped yet); False at the deadline."""
    deadline = time.monotonic() + timeout
    while not _none_alive(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_taken_port_is_a_one_line_error_before_anything_starts(tmp_path, capsys):
    with socket.socket() as holder:  # another server's listening socket
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["serve", "--engine", "sglang", "--model", "smollm2", "--port", str(port), "--run-dir",
                     str(tmp_path / "run"), "--command", f"{sys.executable} {FAKE} crash"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"hstap: error: --port {port}: 127.0.0.1:{port} is already in use by pid {os.getpid()}")
    assert not (tmp_path / "run" / "engine.log").exists()  # nothing was started


def test_ready_only_counts_when_the_engine_itself_holds_the_port(tmp_path, monkeypatch):
    """The engine prints its ready line but never listens; another process's server then answers /health on the
    port. That is not readiness: serve stops in one line naming the other process, and leaves nothing behind."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    port = free_port()
    sup = Supervisor(ServeConfig(engine="sglang", model="smollm2", port=port, run_dir=tmp_path / "run", grace_s=2,
                                 command=[sys.executable, str(FAKE), "liar"], echo=False))
    sup.start()  # the port is free now
    foreign = _foreign_server(tmp_path, port)
    try:
        result = sup.wait_ready()
        assert result is not None, "reported ready for another process's server"
        assert result.status == "port_taken", result
        assert result.diagnosis.startswith(f"port {port} is answered by pid {foreign.pid} "), result.diagnosis
        assert not result.survivors and _none_alive(_pids(tmp_path) + list(sup._known))
    finally:
        _stop(foreign, tmp_path)
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


def test_the_hf_taps_never_firing_stops_serve(tmp_path, monkeypatch):
    """hstap's own taps say in one line that their hooks never fired (tests/serve/test_hf_capture.py): serve stops
    the engine on that line, as on SGLang's 'No modules matched'."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    sup = Supervisor(ServeConfig(engine="sglang", model="smollm2", port=free_port(), run_dir=tmp_path / "run",
                                 grace_s=2, command=[sys.executable, str(FAKE), "silent"], echo=False))
    sup.start()
    try:
        result = sup.wait_ready()
        assert result is not None and result.status == "capture_failed", result
        assert result.diagnosis.startswith("the capture hooks on model.layers.1 (hidden.1) never fired"), result
        assert not result.survivors and _none_alive(_pids(tmp_path) + list(sup._known))
    finally:
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_engine_and_its_children_die_with_the_supervisor(tmp_path, sig):
    """kill -9 of `hstap serve` (no handler, no cleanup) and SIGTERM (its handler) both leave no engine process:
    neither the engine, nor its worker, nor the worker that moved to a session of its own."""
    cmd, env = _serve(tmp_path, "healthy")
    serve = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not lines or ("Ctrl-C stops it" not in lines[-1] and lines[-1]):
            lines.append(serve.stdout.readline())
        assert "Ctrl-C stops it" in lines[-1], "".join(lines)
        tree = psutil.Process(serve.pid).children(recursive=True)  # the keeper, the engine, its two workers
        assert {p.pid for p in tree} >= set(_pids(tmp_path)) and len(_pids(tmp_path)) == 3, (tree, _pids(tmp_path))
        serve.send_signal(sig)
        out, _ = serve.communicate(timeout=60)
        assert _gone([p.pid for p in tree], timeout=60), tree
        if sig == signal.SIGTERM:
            assert serve.returncode == 0 and "stopping the engine (stopped)" in out, out
        else:
            assert serve.returncode == -signal.SIGKILL
    finally:
        if serve.poll() is None:
            serve.kill()
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


PHASES = [
    pytest.param("loading", 5, id="loading"),  # the hang comes before torch is imported: a short timeout is safe
    pytest.param("warmup", 90, id="warmup",  # above the silent model load, which the busy rule halves
                 marks=pytest.mark.skipif(not LOOPS, reason="loads the model: HSTAP_RELIABILITY_LOOPS=1")),
    pytest.param("first-request", 90, id="first-request",
                 marks=pytest.mark.skipif(not LOOPS, reason="loads the model: HSTAP_RELIABILITY_LOOPS=1")),
]


@pytest.mark.parametrize("phase, stall", PHASES)
def test_a_hang_in_each_hf_start_up_phase_is_caught_with_stacks_and_no_orphans(tmp_path, monkeypatch, phase, stall):
    monkeypatch.setenv("HSTAP_FAULT", f"hang-{phase}")
    if phase == "loading":  # the suite's case also proves the fallback: faulthandler, as if py-spy were missing
        monkeypatch.setattr(stacks, "py_spy", lambda: None)
    sup = Supervisor(ServeConfig(engine="hf", model="smollm2", port=free_port(), run_dir=tmp_path / "run",
                                 stall_timeout=stall, grace_s=2, echo=False))
    sup.start()
    try:
        result = sup.wait_ready()
    finally:
        if sup.proc.poll() is None:
            sup.stop()
    assert result is not None and result.status == "hang" and result.phase == phase, result
    assert "processes idle or blocked" in result.diagnosis, result.diagnosis
    dumps = {int(f.stem): f.read_text() for f in (tmp_path / "run" / "stacks").glob("*.txt")}
    assert set(dumps) == set(sup._known), (dumps.keys(), sup._known)  # the keeper and the engine
    assert any("fault_point" in text for text in dumps.values()), dumps  # the hung frame, named
    assert not result.survivors and _none_alive(list(sup._known))
    print(f"\nhang-{phase}: stall timeout {stall} s; {result.diagnosis}; ended {result.elapsed_s:.1f} s after start")
