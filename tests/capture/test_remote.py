"""`hstap capture-remote` against a server that answers every prefill while no tap ever fires (the silent failure
of hooks whose module names the served model does not have): one line, within seconds, not an empty store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hstap.cli import main
from tests.serve.test_supervisor import FAKE, _cleanup, _pids, free_port

CONVERSATIONS = ('{"id": "c0", "messages": [{"role": "user", "content": "What is the capital of France?"}, '
                 '{"role": "assistant", "content": "Paris."}]}\n'
                 '{"id": "c1", "messages": [{"role": "user", "content": "Two plus two?"}, '
                 '{"role": "assistant", "content": "Four."}]}\n')


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"fake engine on {url} never became healthy")


def test_answered_prefills_with_nothing_stored_is_a_one_line_error(tmp_path: Path, capsys):
    port = free_port()
    env = {**os.environ, "FAKE_PIDS": str(tmp_path / "pids")}
    engine = subprocess.Popen([sys.executable, str(FAKE), "healthy", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        (tmp_path / "synth.jsonl").write_text(CONVERSATIONS)
        start = time.monotonic()
        code = main(["capture-remote", "--url", url, "--data", f"jsonl:{tmp_path / 'synth.jsonl'}",
                     "--capture-dir", str(tmp_path / "cap"), "--settle", "2"])
        elapsed = time.monotonic() - start
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "the server answered 2 prefill requests but the engine stored none of them" in err
        assert "engine counters: none written: no tap ever ran" in err and "No modules matched" in err
        assert elapsed < 30, f"took {elapsed:.0f} s"
    finally:
        engine.terminate()
        engine.wait(timeout=30)
        _cleanup(_pids(tmp_path))


def test_a_dead_url_is_given_up_after_the_retries_in_one_line(tmp_path: Path, capsys):
    """Nothing listens on the port (bound, never listening: connections are refused): the probe (GET /v1/models)
    is tried --retries times, then the run ends with one line naming the URL — nothing announced, no wait for a store
    that cannot fill."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{taken.getsockname()[1]}"
        (tmp_path / "synth.jsonl").write_text(CONVERSATIONS)
        code = main(["capture-remote", "--url", url, "--data", f"jsonl:{tmp_path / 'synth.jsonl'}",
                     "--capture-dir", str(tmp_path / "cap"), "--retries", "2", "--concurrency", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"hstap: error: capture-remote: server {url}: GET /v1/models failed (ConnectError: "
                          "[Errno 111] Connection refused, 2 attempts); is it up?"), err
    assert not (tmp_path / "cap" / "requests.jsonl").exists()
