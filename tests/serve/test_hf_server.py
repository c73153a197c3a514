"""The OpenAI-compatible `hf` server, in process over httpx's ASGI transport, on the real SmolLM2."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import httpx
import pytest
import torch

from hstap.data import render_prompt
from hstap.runtime.engine import Engine, Request
from hstap.serve.hf_server import create_app

NAME = "smollm2-test"


class _Client:
    """Synchronous calls into the app, each in its own event loop (the app's engine thread outlives them)."""

    def __init__(self, app):
        self.app = app

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t") as c:
                return await c.request(method, path, **kw)
        return asyncio.run(go())

    def get(self, path: str) -> httpx.Response:
        return self._call("GET", path)

    def post(self, path: str, json: dict) -> httpx.Response:
        return self._call("POST", path, json=json)


@pytest.fixture(scope="module")
def client(target):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core test machine: one intra-op thread runs far faster under load
    app = create_app(target, NAME, max_batch=4)
    yield _Client(app)
    app.state.engine.close()
    torch.set_num_threads(before)


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["object"] == "list"


def test_chat_completion_is_the_greedy_answer(client, target):
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    resp = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 16,
                                                      "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == NAME and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    engine = Engine(target, max_batch=1)
    try:
        prompt = render_prompt(messages, target.tokenizer)
        gen = engine.generate([Request(prompt, 16)])[0]
    finally:
        engine.close()
    assert choice["message"]["content"] == target.tokenizer.decode(gen.tokens)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": gen.completion_tokens,
                             "total_tokens": len(prompt) + gen.completion_tokens}


def test_length_limit_and_sampling(client):
    messages = [{"role": "user", "content": "Tell me a long story about dragons."}]
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "temperature": 0.8,
                                                      "top_p": 0.9, "seed": 5})
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def untrained_drafter(target):
    """An untrained SmolLM2 drafter (2048-token draft vocabulary): speculative serving must not change answers."""
    from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target.model.config, [1, 14, 26], 2048, target.model_id, target.fingerprint)
    drafter = Eagle3Drafter(cfg)
    counts = torch.arange(target.model.config.vocab_size, 0, -1)
    drafter.init_from_target(target.model, *build_draft_vocab(counts, 2048))
    return drafter.eval()


def test_speculative_server_answers_the_same_and_reports_tau(client, target):
    app = create_app(target, NAME, max_batch=2, drafter=untrained_drafter(target), draft="chain:2")
    spec = _Client(app)
    try:
        assert spec.get("/metrics").json()["speculative"]["tau"] is None  # no verification yet
        for content in ["Is the sky blue? Answer yes or no.", "Name a prime number."]:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0}
            plain, fast = client.post("/v1/chat/completions", json=body), spec.post("/v1/chat/completions", json=body)
            assert fast.json()["choices"] == plain.json()["choices"] and fast.json()["usage"] == plain.json()["usage"]
        metrics = spec.get("/metrics").json()
    finally:
        app.state.engine.close()
    assert metrics["requests"] == 2 and metrics["speculative"]["draft"] == "chain:2"
    assert metrics["speculative"]["verify_forwards"] > 0 and metrics["speculative"]["tau"] >= 1.0
    assert client.get("/metrics").json()["speculative"] is None


def test_bad_requests_are_openai_errors(client):
    resp = client.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 404 and "smollm2-test" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "x"}]})
    assert resp.status_code == 400 and "first_not_user" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 10**6})
    assert resp.status_code == 400 and "max_new_tokens" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={"messages": []})  # FastAPI's 422, in OpenAI's shape
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error" and "at least 1" in resp.json()["error"]["message"]


def test_failures_are_openai_errors_too(target, monkeypatch):
    app = create_app(target, NAME, max_batch=1)
    served = _Client(app)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def broken(request, on_tokens=None) -> Future:
        future: Future = Future()
        future.set_exception(RuntimeError("the device fell over"))
        return future

    monkeypatch.setattr(app.state.engine, "submit", broken)
    resp = served.post("/v1/chat/completions", json=body)
    error = resp.json()["error"]
    assert resp.status_code == 500 and error["type"] == "server_error" and "the device fell over" in error["message"]
    events = served.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
    assert '"role": "assistant"' in events[0] and "the device fell over" in events[1], events  # as OpenAI's stream
    monkeypatch.undo()
    app.state.engine.close()
    resp = served.post("/v1/chat/completions", json=body)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable", resp.text
