"""SGLang's CPU engine, live: `hstap serve --engine sglang` starts SGLang 0.5.20 from its own environment
(`.venv-sglang`, engines/sglang.sh) the way a user would, `SGLANG_USE_CPU_ENGINE=1` and the CPU flags after `--`.

A short-lived server first (one engine of this file at a time): a hook spec that matches no module stops serve
from SGLang's own log line. Then one capture server for the rest of the module: capture-remote on real ShareGPT conversations, compared with `hstap
capture` (transformers); `hstap synth` against it; and last every engine process stopped (SIGSTOP) mid-request,
reported as a hang with stacks. (A scheduler stopped in SGLang's warm-up was reported as a HANG during warmup too,
2026-12-06, docs/engines.md; not repeated here: it waits out a whole --stall-timeout, and a shorter one than
SGLang's silent imports need is a false hang on a loaded machine.) The engine serves in fp32, so that only the
store's bf16 rounding separates the two captures (in bf16 SGLang's CPU kernels round differently from
transformers': cosine 0.994 at layer 14 on a few tokens).

`kill -9` of `hstap serve` is proven live on vLLM's three processes (test_vllm_eagle.py's server ends so) and, for
any engine's tree, by tests/serve/test_supervisor_faults.py: the keeper that stops the tree does not know which
engine it holds. An SGLang start killed once its scheduler existed left nothing either (2026-12-06, before this
file dropped the case: a whole SGLang start, ~28 s of the suite's time, for the same keeper).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hstap.models.target import resolve_model_dir
from hstap.store import open_store
from hstap.store.compare import compare_stores
from tests.live.conftest import (CONVERSATIONS, MAX_TOKENS, ROOT, alive, engine_python, free_port,
                                 hang_mid_request, hstap, hstap_serve)

pytestmark = pytest.mark.live_engine

ENV = {"SGLANG_USE_CPU_ENGINE": "1"}  # sglang/srt/utils/common.py:is_cpu(): the CPU platform
# SGLang's CPU engine (0.5.20): torch attention and sampling, no CUDA graphs; a small KV pool (the default sizes
# it from free RAM: 12 GB, allocated in ~47 s on this machine)
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--max-total-tokens", "8192", "--dtype", "float32"]
CHUNK = 64  # --chunked-prefill-size: every conversation longer than this is prefilled over several forwards
N = CONVERSATIONS
HEALTH = 20  # once ready, /health unanswered this long is a hang (a serving SGLang answers it at once)
START_STALL = "180"  # SGLang imports for ~20-40 s without a log line, busy: longer than that, at half


def serve_until_exit(run_dir: Path, *args: str, timeout: float = 400) -> tuple[int, str, set[int], float, list[int]]:
    """Run `hstap serve --engine sglang` until it exits: (exit code, output, every pid of its tree seen, seconds,
    the pids still alive 30 s after it ended — killed then)."""
    cmd = [sys.executable, "-m", "hstap.cli", "serve", "--engine", "sglang", "--port", str(free_port()),
           "--engine-python", str(engine_python("sglang")), "--run-dir", str(run_dir), "--grace", "5", "--model",
           "smollm2", *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    lines, pids = [], {proc.pid}
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)} if proc.poll() is None else set()
            assert time.monotonic() - t0 < timeout, "hstap serve still running:\n" + "\n".join(lines[-40:])
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 30  # a killed serve's keeper stops the group on its own
        while alive(pids - {os.getpid()}) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(pids - {os.getpid()})
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in alive(pids):  # never leave an engine behind, even when the test fails
            psutil.Process(pid).kill()
    return code, "\n".join(lines), pids, took, left


def test_hook_spec_matching_no_module_stops_serve(tmp_path):
    """The engine builds 20 layers (an override of config.json's 30): layer 26's hook spec matches no module.
    SGLang only warns and would serve on; serve stops on that log line, exit 1, one error line, nothing left."""
    code, out, pids, took, left = serve_until_exit(
        tmp_path / "run", "--capture-layers", "auto", "--capture-dir", str(tmp_path / "cap"), "--stall-timeout",
        START_STALL, "--", *CPU_FLAGS, "--json-model-override-args", json.dumps({"num_hidden_layers": 20}))
    log = (tmp_path / "run" / "engine.log").read_text()
    print(f"no-match: serve exited {code} after {took:.0f} s")
    assert code == 1, out[-3000:]
    # 0.5.20's layers return (hidden, residual): the hooks sit on the layers themselves (hstap.capture.arch)
    assert "No modules matched hook spec 'hstap-layer-26' patterns=['model.layers.26']" in log
    errors = [line for line in out.splitlines() if line.startswith("hstap serve: error:")]
    assert len(errors) == 1 and "'hstap-layer-26' matched no module" in errors[0], out[-3000:]
    assert "ready on" not in out and not left


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The capture server: layers auto, chunked prefill at 64 tokens, the radix cache off (hstap's own flags)."""
    d = tmp_path_factory.mktemp("sglang")
    t0 = time.monotonic()
    with hstap_serve("sglang", d / "run", "--model", "smollm2", "--capture-layers", "auto", "--capture-dir",
                     str(d / "cap"), "--stall-timeout", START_STALL, "--health-timeout", str(HEALTH), "--",
                     *CPU_FLAGS, "--chunked-prefill-size", str(CHUNK), env=ENV) as served:
        print(f"sglang capture server ready in {time.monotonic() - t0:.0f} s")
        yield served, d


def _report(cap: Path) -> dict:
    return json.loads((cap / "engine-report.json").read_text())


def test_capture_equals_transformers_capture(server, transformers_capture):
    served, d = server
    cap, ref = d / "cap", transformers_capture
    command = (d / "run" / "command.txt").read_text()
    assert "--disable-radix-cache" in command.split()  # a prefix-cache hit is impossible, not just refused
    t0 = time.monotonic()
    r = hstap("capture-remote", "--url", served.url, "--data", "sharegpt", "--limit", str(N), "--max-tokens",
              str(MAX_TOKENS), "--capture-dir", str(cap))
    t1 = time.monotonic()
    assert r.returncode == 0, r.stdout + r.stderr
    cli = hstap("compare", str(cap), str(ref))
    print(f"capture-remote {t1 - t0:.0f} s\n{cli.stdout}")
    assert cli.returncode == 0 and "verdict: MATCH" in cli.stdout, cli.stdout + cli.stderr

    cmp = compare_stores(cap, ref)  # bf16 stores: each tensor at bf16's tolerance
    assert cmp.common == N and not cmp.only_a and not cmp.only_b and not cmp.token_mismatch, cmp.verdict()
    announced = [json.loads(line) for line in (cap / "requests.jsonl").read_text().splitlines()]
    store = open_store(cap)
    assert sorted(store.ids()) == sorted(a["id"] for a in announced) == sorted(open_store(ref).ids())
    for a in announced:  # exactly the prompt's tokens: no decode row, no warm-up, nothing missing
        sample = store.read(store.index_of(a["id"]))
        assert sample["input_ids"].tolist() == a["input_ids"]
        rows = {k: v.shape[0] for k, v in sample["hidden"].items()} | {"teacher": sample["teacher"]["hidden"].shape[0]}
        assert len(rows) == 4 and set(rows.values()) == {len(a["input_ids"])}, (a["id"], rows)
    report = _report(cap)
    assert report["captured"] == N and report["errors"] == 0 and report["open_partials"] == 0, report
    longer = sum(len(a["input_ids"]) > CHUNK for a in announced)
    assert longer >= 1 and report["stitched"] == longer, report  # each of them really came in several forwards
    assert report["skipped"].get("decode", 0) >= 1 and "refused_prefix_cached" not in report, report


def test_synth_against_sglang_checks_the_served_model_and_resumes(server, tmp_path):
    """`hstap synth --server`: SGLang serves the model under its path; another --model is refused in one line.
    A re-run with a larger --limit only generates the new conversations. Its decode steps are never stored."""
    served, d = server
    before = _report(d / "cap")
    wrong = hstap("synth", "--server", served.url, "--model", "someone/else", "--data", "sharegpt", "--limit", "1",
                  "--out", str(tmp_path / "wrong.jsonl"))
    assert wrong.returncode != 0 and "serves '" in wrong.stderr and "someone/else" in wrong.stderr, wrong.stderr
    out = tmp_path / "synth.jsonl"
    args = ["synth", "--server", served.url, "--data", "sharegpt", "--max-new-tokens", "12", "--temperature", "0",
            "--out", str(out)]
    t0 = time.monotonic()
    first = hstap(*args, "--limit", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    again = hstap(*args, "--limit", "3")
    print(f"synth: {time.monotonic() - t0:.0f} s for 3 conversations")
    assert again.returncode == 0 and "1 conversations to generate (2 already in" in again.stdout, again.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and len({r["id"] for r in records}) == 3
    served_as = {r["model"] for r in records}  # SGLang's id for the model: its path, as /v1/models lists it
    assert served_as == {str(resolve_model_dir("smollm2")[0])}, served_as
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip() for r in records)
    time.sleep(2.5)  # the engine writes its counters within flush_s (1 s) of a change
    after = _report(d / "cap")  # synth's prompts are the captured conversations' first turns: never whole samples
    assert after["captured"] == before["captured"] and after["skipped"]["decode"] > before["skipped"]["decode"]
    assert len(open_store(d / "cap")) == N and after["errors"] == 0, after


def test_an_engine_stopped_mid_request_is_a_hang_with_stacks(server):
    """Last: it ends the module's server. While a long generation decodes (SGLang logs its decode batches), SIGSTOP
    every engine process: `hstap serve` finds /health unanswered for --health-timeout, reports a HANG during ready
    with each process's Python stacks (py-spy, the stopped scheduler's included) and stops them all."""
    served, _ = server
    seen = len(served.lines)
    hang = hang_mid_request(served, lambda: any("Decode batch" in line for line in served.lines[seen:]), HEALTH)
    dumped = {int(p.stem): p.read_text() for p in (served.run_dir / "stacks").glob("*.txt")}
    assert {p.pid for p in hang.stopped} <= set(dumped), (sorted(dumped), [p.pid for p in hang.stopped])
    assert any("run_scheduler_process" in text for text in dumped.values()), "the scheduler's stack"
