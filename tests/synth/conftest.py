"""Fixtures for synth tests: one intra-op thread, short real prompts, and real local servers in subprocesses.

The test machine has 2 cores shared with other jobs; torch's intra-op threads spin-wait, so two threads on a
busy core run ~10x slower than one. Every model these tests run (in process or in a server) uses one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from hstap.serve.ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SHORT_QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Is the sky blue? Answer yes or no.",
    "Name a prime number between 10 and 20.",
    "Give me a synonym for happy.",
    "What is 2 + 2?",
    "Which planet is known as the red planet?",
    "Say hello in Spanish.",
    "What color is grass?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Name one ocean.",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def short_prompts(tmp_path_factory) -> Path:
    """Twelve one-turn chats with short answers: server tests stay fast on a CPU."""
    records = [{"id": f"q{k:02d}", "messages": [{"role": "user", "content": q}]} for k, q in enumerate(SHORT_QUESTIONS)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "short.jsonl", records)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextmanager
def server(tmp_path: Path, *args: str, ready_s: float = 120.0):
    """Start tests/synth/faulty_server.py on a free loopback port; yield (url, process); stop it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    errlog = open(tmp_path / f"server-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, str(HERE / "faulty_server.py"), "--port", str(port), *args],
                            cwd=ROOT, env=ENV, stdout=errlog, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(tmp_path / f'server-{port}.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server on {url} not healthy after {ready_s} s")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        errlog.close()


@pytest.fixture(scope="session")
def healthy_server(tmp_path_factory):
    """A well-behaved server that logs the requests it receives: (url, log path)."""
    tmp = tmp_path_factory.mktemp("healthy")
    log = tmp / "requests.jsonl"
    with server(tmp, "--log", str(log)) as (url, _):
        yield url, log
