"""`hstap serve` with real subprocesses: a busy-loop hang during warmup, a crash, Ctrl-C, refused flags."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from hstap.cli import main
from hstap.serve.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_engine.py")


def _serve(tmp_path, mode: str, *extra: str) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "hstap.cli", "serve", "--engine", "sglang", "--model", "smollm2",
           "--port", str(free_port()), "--run-dir", str(tmp_path / "run"), "--grace", "2",
           "--command", f"{sys.executable} {FAKE} {mode}", *extra]
    env = {**os.environ, "FAKE_PIDS": str(tmp_path / "pids"), "PYTHONUNBUFFERED": "1"}
    return cmd, env


def _pids(tmp_path) -> list[int]:
    return [int(x) for x in (tmp_path / "pids").read_text().split()]


def _none_alive(pids: list[int]) -> bool:
    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return not any(alive(p) for p in pids)


def _cleanup(pids: list[int]) -> None:
    for pid in pids:  # only if a test failed half-way: never leave a spinning process behind
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def test_busy_loop_in_warmup_is_a_hang_with_stacks_and_no_orphans(tmp_path):
    cmd, env = _serve(tmp_path, "hang", "--stall-timeout", "6")
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
        pids = _pids(tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "HANG during warmup" in done.stdout and "busy loop" in done.stdout, done.stdout
        assert elapsed < 60, f"detected after {elapsed:.0f} s"
        stacks = sorted((tmp_path / "run" / "stacks").glob("*.txt"))
        assert {int(p.stem) for p in stacks} >= set(pids), (stacks, pids)  # the detached worker included
        assert "spin_forever" in (tmp_path / "run" / "stacks" / f"{pids[0]}.txt").read_text()
        assert "Capture cuda graph begin" in (tmp_path / "run" / "engine.log").read_text()
        assert _none_alive(pids), "an engine process survived"
    finally:
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


def test_crash_reports_exit_code_and_last_lines(tmp_path):
    cmd, env = _serve(tmp_path, "crash")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "exited with code 3 during loading" in done.stdout, done.stdout
    assert "RuntimeError: CUDA out of memory (fake)" in done.stdout.split("last log lines:")[-1]
    assert _none_alive(_pids(tmp_path))


def serve_then_ctrl_c(tmp_path, mode: str, *extra: str) -> tuple[str, str]:
    """`hstap serve` over the fake engine until it says ready, then Ctrl-C: (its output until ready, the rest).
    Asserts it was ready, exited 0 and left no engine process."""
    cmd, env = _serve(tmp_path, mode, *extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops it" in line or not line:
                break
        assert any("ready on" in x for x in lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert _none_alive(_pids(tmp_path))
        return "".join(lines), out
    finally:
        if proc.poll() is None:
            proc.kill()
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


def test_ctrl_c_stops_the_engine_group_cleanly(tmp_path):
    _, out = serve_then_ctrl_c(tmp_path, "healthy")
    assert "stopping the engine (stopped)" in out


@pytest.mark.parametrize("mode, needle", [
    ("nomatch", "capture hook spec 'hstap-final-norm' matched no module of the served model (patterns ['model.norm'])"),
    ("twomatch", "capture hook spec 'hstap-layer-1' matched 2 modules (model.layers.1, vision_tower.layers.1)"),
])
def test_a_capture_hook_that_matches_no_module_stops_serve_in_one_line(tmp_path, mode, needle):
    cmd, env = _serve(tmp_path, mode, "--capture-dir", str(tmp_path / "cap"), "--capture-layers", "1,14,26")
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
        assert done.returncode == 1, done.stdout + done.stderr
        final = done.stdout.strip().splitlines()[-1]
        assert final.startswith("hstap serve: error: " + needle) and "engine stopped" in final, done.stdout
        assert elapsed < 30, f"stopped after {elapsed:.0f} s"
        assert _none_alive(_pids(tmp_path))
    finally:
        _cleanup(_pids(tmp_path) if (tmp_path / "pids").exists() else [])


def test_flags_that_break_capture_are_refused(tmp_path, capsys):
    base = ["serve", "--engine", "sglang", "--model", "smollm2", "--capture-dir", str(tmp_path / "cap"), "--plan"]
    assert main([*base, "--", "--enable-two-batch-overlap"]) == 2
    err = capsys.readouterr().err
    assert "--enable-two-batch-overlap breaks capture" in err and err.count("\n") == 1
    assert main([*base, "--", "--pp-size", "2"]) == 2
    assert "--pp-size 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--engine", "tgi", "--model", "smollm2", "--plan"])
    assert exit_info.value.code == 2 and "invalid choice: 'tgi' (choose from 'sglang', 'vllm', 'hf')" in capsys.readouterr().err


def test_plan_shows_the_capture_flags(tmp_path, capsys):
    assert main(["serve", "--engine", "sglang", "--model", "smollm2", "--capture-dir", str(tmp_path / "cap"),
                 "--capture-layers", "1,14,26", "--plan", "--", "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["serve"]["extra"] == ["--tp-size", "2"]  # the plan is a config file ...
    cmd = out.rstrip().splitlines()[-1]  # ... ending in the engine command, as a comment
    assert "sglang.launch_server" in cmd and "--forward-hooks" in cmd and "hstap.capture.sglang:make_hook" in cmd
    assert "--disable-radix-cache" in cmd and "--cuda-graph-backend-prefill disabled" in cmd
    assert cmd.endswith("--tp-size 2")
    assert main(["serve", "--engine", "vllm", "--model", "smollm2", "--capture-dir", str(tmp_path / "cap"),
                 "--plan"]) == 0
    cmd = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert cmd.startswith("# VLLM_SERVER_DEV_MODE=1") and "--enforce-eager" in cmd and "--worker-extension-cls" in cmd


CONVERSATIONS = [
    '{"id": "c0", "messages": [{"role": "user", "content": "What is the capital of France?"}]}',
    '{"id": "c1", "messages": [{"role": "user", "content": "Name three primary colors."}]}',
    '{"id": "c2", "messages": [{"role": "system", "content": "Answer briefly."}, '
    '{"role": "user", "content": "How many legs does a spider have?"}]}',
]


def _hstap(*args: str) -> subprocess.CompletedProcess:
    """A client command run in this process (the server is the separate process under test): its exit code and
    output, as a subprocess would give them, without another interpreter start-up."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["hstap", *args], code, out.getvalue(), err.getvalue())


def test_hf_engine_serve_synth_capture_equals_the_embedded_capture(tmp_path, target):
    """The whole path on a CPU: serve (taps on, speculative decoding with a drafter) -> synth through it ->
    prefill the synth output through it -> the engine's store equals `hstap capture` of the same file, by
    `hstap compare`; the server's /metrics report τ."""
    from tests.serve.test_hf_server import untrained_drafter

    drafter_dir = tmp_path / "drafter"
    untrained_drafter(target).save_pretrained(drafter_dir, include_embedding=False)
    (tmp_path / "prompts.jsonl").write_text("\n".join(CONVERSATIONS) + "\n")
    url, cap, synth = f"http://127.0.0.1:{free_port()}", tmp_path / "cap", tmp_path / "synth.jsonl"
    serve = subprocess.Popen([sys.executable, "-m", "hstap.cli", "serve", "--engine", "hf", "--model", "smollm2",
                              "--port", url.rsplit(":", 1)[1], "--capture-layers", "1,14,26", "--capture-dir",
                              str(cap), "--run-dir", str(tmp_path / "run"), "--stall-timeout", "120",
                              "--drafter", str(drafter_dir), "--draft", "tree:3,2,4",
                              "--ready-timeout", "300"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    engine = []
    try:
        lines, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline:
            lines.append(serve.stdout.readline())
            if "Ctrl-C stops it" in lines[-1] or not lines[-1]:
                break
        assert "Ctrl-C stops it" in lines[-1], "".join(lines)
        engine = [serve.pid] + [c.pid for c in psutil.Process(serve.pid).children(recursive=True)]
        done = _hstap("synth", "--server", url, "--data", f"jsonl:{tmp_path / 'prompts.jsonl'}", "--out", str(synth),
                      "--max-new-tokens", "12")
        assert done.returncode == 0, done.stdout + done.stderr
        spec = httpx.get(f"{url}/metrics", timeout=10).json()["speculative"]
        assert spec["draft"] == "tree:3,2,4" and spec["verify_forwards"] > 0 and spec["tau"] >= 1.0
        done = _hstap("capture-remote", "--url", url, "--data", f"jsonl:{synth}", "--capture-dir", str(cap),
                      "--timeout", "120")
        assert done.returncode == 0 and "3 stored" in done.stdout, done.stdout + done.stderr
        again = _hstap("capture-remote", "--url", url, "--data", f"jsonl:{synth}", "--capture-dir", str(cap))
        assert "sent 0 samples (3 already in the store)" in again.stdout, again.stdout + again.stderr
        serve.send_signal(signal.SIGINT)
        out, _ = serve.communicate(timeout=60)
        assert serve.returncode == 0, out
    finally:
        if serve.poll() is None:
            serve.kill()
    assert _none_alive(engine)
    emb = tmp_path / "embedded"
    assert main(["capture", "--data", f"jsonl:{synth}", "--out", str(emb), "--teacher", "hidden",
                 "--layers", "1,14,26"]) == 0
    done = _hstap("compare", str(cap), str(emb))
    assert done.returncode == 0 and "verdict: MATCH — 3 samples" in done.stdout, done.stdout
