"""The `hf` server under the real `openai` client, on 127.0.0.1 (uvicorn in a thread), with the real SmolLM2.

Two servers per module, as `hstap serve --engine hf` builds them: plain decoding, and the shipped reference drafter
with `--draft hybrid:4,2`. Streaming gives the non-streaming answer token for token, stop strings end answers,
concurrent streams share the batch, a client that leaves frees its row, and errors parse into openai's exceptions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

from hstap.serve.hf_capture import create_capture_app

NAME = "smollm2-test"
STORY = "Write a short story about a dragon who learns to bake bread."
OPEN_ENDED = [STORY, "Explain how rain forms, step by step.", "Describe a busy city market in the morning.",
              "Give me advice for a first day at a new job."]


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port (the OS picks it), in a thread of this process so the session's
    SmolLM2 is shared; → its base URL. Shutting down runs the app's lifespan, which closes its engine."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core test machine: one intra-op thread runs far faster under load
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain(target) -> Iterator[str]:
    """What `hstap serve --engine hf --model smollm2` serves (no capture: the lean prefill)."""
    with serving(create_capture_app(target, NAME, None, max_batch=4, prefill="lean")) as url:
        yield url


@pytest.fixture(scope="module")
def spec(target) -> Iterator[str]:
    """`... --drafter reference --draft hybrid:4,2`."""
    from hstap.drafter.load import load_drafter

    app = create_capture_app(target, NAME, None, max_batch=4, drafter=load_drafter("reference", target),
                             draft="hybrid:4,2", prefill="lean")
    with serving(app) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str) -> dict:
    return httpx.get(f"{url}/metrics", timeout=30).json()


def ask(url: str, content: str, **kw):
    """One non-streaming greedy answer."""
    return client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                               temperature=0, **kw)


def ask_streaming(url: str, content: str, **kw) -> list:
    """One streaming greedy answer's chunks, usage included."""
    stream = client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 **kw)
    return list(stream)


def streamed_text(chunks: list) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def finish_reasons(chunks: list) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


@pytest.mark.parametrize("server", ["plain", "spec"])
def test_streaming_gives_the_non_streaming_answer_as_it_is_decoded(server, request):
    url = request.getfixturevalue(server)
    full = ask(url, STORY, max_tokens=24)
    before = metrics(url)["speculative"]
    chunks = ask_streaming(url, STORY, max_completion_tokens=24)  # OpenAI's newer name for max_tokens
    pieces = streamed_text(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(pieces) == full.choices[0].message.content
    assert finish_reasons(chunks) == [full.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens == 24
    assert len(pieces) >= 3, pieces  # delivered as decoded, not in one piece at the end
    if server == "spec":  # one piece per verification at most (a partial character waits for the next one)
        forwards = metrics(url)["speculative"]["verify_forwards"] - before["verify_forwards"]
        assert len(pieces) <= forwards + 1, (pieces, forwards)


def test_the_drafter_answers_the_plain_answers(plain, spec):
    for content in OPEN_ENDED[1:2]:
        assert ask(spec, content, max_tokens=24).choices[0].message.content == \
            ask(plain, content, max_tokens=24).choices[0].message.content
    assert metrics(spec)["speculative"]["tau"] > 1.0  # the drafter's tokens were accepted: it really drafted


@pytest.mark.parametrize("server", ["plain", "spec"])
def test_stop_strings_end_the_answer_and_are_not_returned(server, request):
    url = request.getfixturevalue(server)
    base = ask(url, STORY, max_tokens=24)
    text = base.choices[0].message.content
    early, late = text[len(text) // 3: len(text) // 3 + 5], text[2 * len(text) // 3: 2 * len(text) // 3 + 4]
    assert early.strip() and late.strip(), text
    for stop in (early, ["never in this answer", late, early]):
        stops = [stop] if isinstance(stop, str) else stop
        expected = text[:min(text.find(s) for s in stops if s in text)]  # the first stop string to appear
        full = ask(url, STORY, max_tokens=24, stop=stop)
        chunks = ask_streaming(url, STORY, max_tokens=24, stop=stop)
        assert full.choices[0].message.content == expected == "".join(streamed_text(chunks)), (stop, text)
        assert full.choices[0].finish_reason == "stop" and finish_reasons(chunks) == ["stop"]
        assert chunks[-1].usage.model_dump() == full.usage.model_dump()
        assert full.usage.completion_tokens < base.usage.completion_tokens  # decoding ended there


def test_concurrent_streams_share_the_batch_and_get_their_own_answers(plain):
    solo = [ask(plain, q, max_tokens=16).choices[0].message.content for q in OPEN_ENDED]
    assert metrics(plain)["batching"]["max_rows"] < len(OPEN_ENDED)  # every request so far came alone
    start = threading.Barrier(len(OPEN_ENDED))

    def stream(question: str) -> str:
        start.wait()
        return "".join(streamed_text(ask_streaming(plain, question, max_tokens=16)))

    with ThreadPoolExecutor(len(OPEN_ENDED)) as pool:
        together = list(pool.map(stream, OPEN_ENDED))
    assert together == solo
    assert metrics(plain)["batching"]["max_rows"] == len(OPEN_ENDED)


@pytest.mark.parametrize("server", ["plain", "spec"])
def test_a_client_that_leaves_mid_stream_frees_its_row(server, request):
    url = request.getfixturevalue(server)
    before = metrics(url)
    stream = client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": STORY}],
                                                 temperature=0, max_tokens=400, stream=True)
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        if pieces == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while (after := metrics(url))["batching"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after["batching"]["active"] == 0 and after["disconnected"] == before["disconnected"] + 1
    assert after["batching"]["ended_early"] == before["batching"]["ended_early"] + 1  # freed, not run to its end
    assert after["requests"] == before["requests"]
    assert ask(url, "Say hello in Spanish.", max_tokens=8).choices[0].message.content  # still serving


BAD = [({"n": 2}, openai.BadRequestError, "n", "n=2 is not supported"),
       ({"n": 2, "stream": True}, openai.BadRequestError, "n", "one choice per request"),
       ({"logprobs": True}, openai.BadRequestError, "logprobs", "logprobs=True is not supported"),
       ({"top_logprobs": 3}, openai.BadRequestError, "top_logprobs", "no log probabilities"),
       ({"max_tokens": "many"}, openai.BadRequestError, "max_tokens", "max_tokens: Input should be a valid integer"),
       ({"temperature": 5}, openai.BadRequestError, "temperature", "temperature: Input should be less than"),
       ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop", "up to 4 non-empty strings"),
       ({"stream_options": {"include_usage": True}}, openai.BadRequestError, "stream_options", "only allowed"),
       ({"messages": [{"role": "robot", "content": "hi"}]}, openai.BadRequestError, "messages[0].role",
        "messages[0].role: Input should be 'system', 'user' or 'assistant'"),
       ({"model": "gpt-4o"}, openai.NotFoundError, "model", "model 'gpt-4o' is not served here")]


@pytest.mark.parametrize(("change", "error", "param", "message"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_errors_reach_the_openai_client_in_its_shape(plain, change, error, param, message):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **change}
    with pytest.raises(error) as info:
        client(plain).chat.completions.create(**body)
    exc = info.value
    assert exc.param == param and exc.type == "invalid_request_error", exc.body
    assert str(exc).startswith(f"Error code: {exc.status_code} - ") and message in str(exc), str(exc)


def test_completions_route_errors_in_openai_shape_and_answers_text(plain, target):
    with pytest.raises(openai.BadRequestError, match="expected a list of token ids") as info:
        client(plain).completions.create(model=NAME, prompt="Hello")
    assert info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError, match="stream: not supported on /v1/completions"):
        client(plain).completions.create(model=NAME, prompt=[1, 2, 3], stream=True)
    answer = client(plain).completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=3)
    assert answer.choices[0].text == target.tokenizer.decode(answer.choices[0].token_ids)
    missing = httpx.get(f"{plain}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("GET /v1/nothing-here")
