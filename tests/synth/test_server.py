"""The server backend: retries, round-robin and model checks on a mock transport, then against real local servers
(one that answers 500 and stalls at random, one that dies mid-run) wrapping the embedded SmolLM2; and `hstap synth`
as a process against them: SIGKILL mid-run leaves only whole lines, and a re-run completes the exact set."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hstap.cli import main
from hstap.synth.backend import RequestFailed, TurnSampling
from hstap.synth.config import SynthConfig
from hstap.synth.run import run_synth
from hstap.synth.server import ModelMismatch, ServerBackend
from hstap.synth.writer import failed_path
from tests.synth.conftest import ENV, ROOT, SHORT_QUESTIONS, read_records, server, write_jsonl

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SAMPLING = TurnSampling(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
ASK = [{"role": "user", "content": "hi"}]


def _answer(model=MODEL, content="hello"):
    choice = {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    return {"model": model, "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}


def _mock(script: list, seen: list, models=(MODEL,)):
    """A transport answering /v1/models with `models` and chat requests with `script` items in turn."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": m} for m in models]})
        seen.append(request.url.host)
        item = script[min(len(seen) - 1, len(script) - 1)]
        if isinstance(item, Exception):
            raise item
        status, body = item
        return httpx.Response(status, json=body)
    return httpx.MockTransport(handle)


def _complete(script, urls=("http://a:1",), retries=3, models=(MODEL,), model=None):
    seen: list[str] = []

    async def go():
        async with ServerBackend(list(urls), model=model, timeout=5.0, retries=retries, backoff=0.0,
                                 max_connections=4, seed=0, transport=_mock(script, seen, models)) as backend:
            return backend.model_id, await backend.complete(ASK, SAMPLING)

    return asyncio.run(go()), seen


def test_transient_failures_are_retried_round_robin():
    script = [(500, {}), httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), (200, _answer())]
    (model, done), seen = _complete(script, urls=("http://a:1", "http://b:2/v1/"))
    assert model == MODEL, "the model id defaults to what the first server serves"
    assert done.content == "hello" and done.finish_reason == "stop" and done.completion_tokens == 2
    assert seen == ["a", "b", "a", "b"]


def test_gives_up_after_the_retries_and_fails_4xx_at_once():
    with pytest.raises(RequestFailed, match="gave up after 3 attempts.*HTTP 503"):
        _complete([(503, {})], retries=2)
    with pytest.raises(RequestFailed, match="HTTP 400"):
        _complete([(400, {"error": "bad"}), (200, _answer())])


def test_a_server_of_another_model_is_a_clear_error():
    with pytest.raises(ModelMismatch, match=r"serves 'other/model', not .*SmolLM2"):
        _complete([(200, _answer())], models=("other/model",), model=MODEL)
    with pytest.raises(ModelMismatch, match=r"answered with model 'other/model'"):
        _complete([(200, _answer(model="other/model"))])


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faulty")
    log = tmp / "requests.jsonl"
    with server(tmp, "--p500", "0.3", "--pslow", "0.25", "--slow-s", "8", "--seed", "3", "--log", str(log)) as (url, _):
        yield url, log


def _cfg(out: Path, data: Path, servers: list[str], **kw) -> SynthConfig:
    base = dict(data=f"jsonl:{data}", out=out, servers=servers, max_new_tokens=8, concurrency=4, timeout=5.0,
                retries=8, backoff=0.05)
    return SynthConfig(**{**base, **kw})


def test_faults_are_retried_until_every_record_is_written(tmp_path, short_prompts, faulty_server, healthy_server):
    (bad, bad_log), (good, good_log) = faulty_server, healthy_server
    result = run_synth(_cfg(tmp_path / "o.jsonl", short_prompts, [bad, good]), progress=False)
    assert result.failed == 0 and result.written == len(SHORT_QUESTIONS), result.summary()
    records = read_records(tmp_path / "o.jsonl")
    assert sorted(r["id"] for r in records) == [f"q{k:02d}" for k in range(len(SHORT_QUESTIONS))]
    for r in records:
        assert r["model"] == MODEL and r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
        assert r["finish_reason"] in ("stop", "length") and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
    faults = [json.loads(line)["fault"] for line in bad_log.read_text().splitlines()]
    assert "500" in faults and "slow" in faults, "the fixed seed makes both faults happen"
    assert good_log.exists(), "round-robin reached the second server too"


def test_server_dying_mid_run_then_resume_completes_the_set(tmp_path, short_prompts, healthy_server):
    out = tmp_path / "o.jsonl"
    results = []
    with server(tmp_path) as (url, proc):
        cfg = _cfg(out, short_prompts, [url], concurrency=2, retries=2)
        runner = threading.Thread(target=lambda: results.append(run_synth(cfg, progress=False)))
        runner.start()
        deadline = time.time() + 120
        while (not out.exists() or len(out.read_text().splitlines()) < 3) and time.time() < deadline:
            time.sleep(0.05)
        proc.kill()
        runner.join(timeout=120)
    assert not runner.is_alive() and results, "the run must end by itself once the server is gone"
    first = results[0]
    assert first.failed > 0 and first.written >= 3
    assert first.written + first.failed + first.report.total == len(SHORT_QUESTIONS)
    failed = [json.loads(line) for line in failed_path(out).read_text().splitlines()]
    assert len(failed) == first.failed and all("ConnectError" in f["reason"] for f in failed)

    second = run_synth(_cfg(out, short_prompts, [healthy_server[0]]), progress=False)
    assert second.resumed == first.written and second.failed == 0
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == len(set(ids)) == len(SHORT_QUESTIONS) - first.report.total
    assert not failed_path(out).exists()


def test_multi_turn_sends_the_targets_own_answers_in_order(tmp_path, healthy_server):
    url, log = healthy_server
    convs = [{"id": f"mt{k}", "messages": [
        {"role": "user", "content": first}, {"role": "assistant", "content": "ORIGINAL ANSWER"},
        {"role": "user", "content": "Now say it again in French."}]}
        for k, first in enumerate(["Name a color of the sky.", "Name a fruit."])]
    data = write_jsonl(tmp_path / "mt.jsonl", convs)
    result = run_synth(_cfg(tmp_path / "o.jsonl", data, [url], turns="all"), progress=False)
    assert result.written == 2, result.summary()
    seen = [json.loads(line)["messages"] for line in log.read_text().splitlines()]
    for rec in read_records(tmp_path / "o.jsonl"):
        msgs = rec["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert "ORIGINAL ANSWER" not in {m["content"] for m in msgs}
        asked = [s for s in seen if s[0]["content"] == msgs[0]["content"]]
        assert asked == [msgs[:1], msgs[:3]], "turn 2 is asked after turn 1, with the target's own answer"
        assert [t["finish_reason"] for t in rec["turns"]] and len(rec["turns"]) == 2


def test_wrong_model_id_is_a_one_line_error(tmp_path, short_prompts, healthy_server, capsys):
    code = main(["synth", "--server", healthy_server[0], "--model", "some/other-model", "--data",
                 f"jsonl:{short_prompts}", "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "serves 'HuggingFaceTB/SmolLM2-135M-Instruct', not 'some/other-model'" in err


# `hstap synth` as a process. Here, not in a file of its own, so that it shares this file's session server: on
# another xdist worker it started a healthy server of its own (~5 s of a core).
def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def test_sigkill_mid_run_then_resume_is_exact(tmp_path, short_prompts, healthy_server):
    """Each run SIGKILLs itself right after its n-th whole record (HSTAP_FAULT, no timer), with other requests
    still in flight: the file holds only whole lines, and a re-run completes the exact set."""
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "hstap.cli", "synth", "--server", healthy_server[0], "--data",
           f"jsonl:{short_prompts}", "--out", str(out), "--max-new-tokens", "8", "--concurrency", "2"]
    written = 0
    for kill_after in (2, 4):
        proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, "HSTAP_FAULT": f"record-written:{kill_after}"},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        written += kill_after
        text = out.read_text(encoding="utf-8")
        assert text.endswith("\n"), "no partial line"
        ids = [json.loads(line)["id"] for line in text.splitlines()]  # every line is a whole JSON record
        assert len(ids) == len(set(ids)) == written
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed past" in done.stdout
    ids = [json.loads(line)["id"] for line in _lines(out)]
    assert sorted(ids) == [f"q{k:02d}" for k in range(len(SHORT_QUESTIONS))], "exact set, no duplicates"
