"""Shared fixtures: the real SmolLM2 (loaded once per session) and its tokenizer.

Converted weights are cached under $HSTAP_CACHE (default ~/.cache/hstap), so only the first session pays the
~30 s GGUF conversion.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# `make test` runs two xdist workers on two cores, and the tests start engines and trainers in subprocesses: idle
# OpenMP threads must sleep, not spin, or every oversubscribed matmul waits on a spinning sibling. Set before
# torch loads; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "PYTEST_XDIST_WORKER" in os.environ:  # one worker per core already fills the cores: a second thread per worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # only oversubscribes them (measured: -7 % of the suite's time)

import pytest  # noqa: E402
import torch  # noqa: E402


# The files that take longest (seconds of one core, `pytest -n 2 --dist loadfile`, 2026-12-06, --junitxml, summed per
# file) run first. xdist hands whole files to its two workers in collection order when `make test` passes
# --no-loadscope-reorder; by default it sorts them by their number of tests, which sent the slow few-test files
# last and left one worker running alone for the last minute. Any file missing here keeps its place after them.
# After the live engines' files, the next two do not both need the shared small store the first one builds, so
# no worker waits on its lock.
SLOWEST_FIRST = ["live/test_vllm_eagle.py", "live/test_vllm.py", "live/test_sglang.py",
                 "train/test_run.py", "capture/test_tensor_parallel.py", "synth/test_server.py", "train/test_ddp.py",
                 "test_recipe.py", "serve/test_supervisor.py", "runtime/test_spec.py", "capture/test_run.py",
                 "serve/test_openai_client.py", "runtime/test_stream.py", "capture/test_sglang_versions.py",
                 "train/test_online.py", "runtime/test_engine.py", "train/test_replay.py", "train/test_learning.py",
                 "train/test_store_source.py", "capture/test_run_faults.py", "evaluate/test_run.py",
                 "runtime/test_fused_drafter.py", "synth/test_run.py", "train/test_merge_kernel.py",
                 "capture/test_sglang.py", "train/test_simulated_tau.py", "train/test_init_grow.py",
                 "serve/test_supervisor_faults.py", "train/test_stop_resume.py", "capture/test_sglang_fusion.py",
                 "capture/test_vllm_extract.py"]


def _schedule_rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_schedule_rank)  # stable: tests keep their order inside a file
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def target():
    from hstap.models import load_target

    torch.manual_seed(0)
    return load_target("smollm2")


@pytest.fixture(scope="session")
def tokenizer():
    from hstap.models import load_tokenizer

    return load_tokenizer("smollm2")


def _shared_root(tmp_path_factory) -> Path:
    """The temp root every xdist worker of this run shares (this process's own root without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def shared_json(tmp_path_factory, name: str, build: Callable[[], object]) -> object:
    """`build()` once per run, shared by the xdist workers as JSON in their common temp root (a lock orders them):
    for a deterministic session fixture that tests on both workers read, so the second worker reads it instead
    of computing it again."""
    import fcntl
    import json

    root = _shared_root(tmp_path_factory)
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(build()))
            tmp.replace(path)  # whole or absent: a worker that failed half-way left nothing to read
        return json.loads(path.read_text())


SMALL_STORE = dict(limit=48, max_tokens=96)  # the small store's capture: online runs re-render exactly these


def shared_dir(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(DIR)` once per run, DIR shared by the xdist workers in their common temp root (a lock orders them, so
    the second worker waits and reads it instead of computing it again); a marker written after `build` returns
    says DIR is whole (a worker that failed half-way leaves it to be rebuilt)."""
    import fcntl
    import shutil

    root = _shared_root(tmp_path_factory)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    """A real capture of 48 short ShareGPT conversations: enough for the tests that train a few steps (resume,
    DDP, online = offline, time budget, bad stores, learning), cheap enough to build in seconds. Built once per
    run and shared by the xdist workers: every test only reads it, and each worker building its own cost ~25 s of
    a core."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.run import run_capture

    def build(out: Path) -> None:
        result = run_capture(CaptureConfig(out=out / "store", batch_tokens=4096, **SMALL_STORE), progress=False)
        assert result.tap_report.errors == 0 and result.captured == SMALL_STORE["limit"]

    return shared_dir(tmp_path_factory, "small_store", build) / "store"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write into. Modes do not stop root, so as root a read-only tmpfs is mounted
    there (and unmounted after); as another user the directory is chmod 555. Skipped where neither works."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    yield from _tmpfs(path, "ro,size=64k", "running as root and cannot mount a read-only tmpfs")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KB filesystem (a tmpfs; root only, skipped otherwise): a real ENOSPC for anything bigger."""
    path = tmp_path / "tiny-disk"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield from _tmpfs(path, "size=64k", "cannot mount a small tmpfs")


def _tmpfs(path, options: str, why_not: str):
    """Mount a tmpfs with `options` on `path` for the fixture's lifetime; skip (saying `why_not`) if mount fails."""
    import subprocess

    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"{why_not}: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
