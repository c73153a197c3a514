"""An OpenAI-compatible chat server over a transformers target: what `hstap synth --server` and tests talk to.

    python -m hstap.serve.hf_capture --model smollm2 --port 8000 [--host 127.0.0.1] [--name NAME] [--max-batch 8]
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0, "stream": true}'

Endpoints: `POST /v1/chat/completions` (messages, max_tokens or max_completion_tokens, temperature, top_p, seed,
stop, stream with stream_options.include_usage; n = 1, no logprobs: refused, not ignored), `GET /v1/models`,
`GET /health`, `GET /metrics` (requests served, clients that left mid-stream, batching: requests decoding now and
the most decoded together; with a drafter the speculative totals and τ). Every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}` (hstap.serve.openai_api). Prompts are rendered with
`hstap.data.render_prompt`, i.e. token for token as capture renders them. Requests are decoded together by
`hstap.runtime.engine.Engine` (up to `max_batch` rows; CUDA graphs on a GPU): on a CPU a request starts as soon as
a row is free (continuous batching), on CUDA (where static batches measured faster) and speculatively (a drafter
or an `ngram:K` draft) in the next batch: greedy answers are the same tokens either way, speculative ones only
faster. A stream gets each host read's tokens (every verification, speculatively) as they come, except on the
static CUDA path without a drafter, which delivers a batch's tokens when it ends. A stop string, or a client that
leaves, frees the request's row at the next host read.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from hstap.data.checks import message_problem
from hstap.data.render import render_prompt
from hstap.errors import HstapError
from hstap.runtime.engine import Engine, Request
from hstap.serve.openai_api import (
    ApiError,
    ChatRequest,
    install_error_handlers,
    max_new_tokens,
    refuse_unsupported,
)
from hstap.serve.text import TextStream


class Answer:
    """One request on the engine: its tokens carried from the decode worker thread into this event loop as text."""

    def __init__(self, engine: Engine, request: Request, text: TextStream):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()  # token batches, then None: decoding ended
        self.gone = False
        self.text, self.prompt_tokens = text, len(request.prompt)
        self.generation = None
        if engine.closed:
            raise ApiError(503, "the server is shutting down: send the request to another server", code="unavailable")
        try:
            self.future = engine.submit(request, on_tokens=self._on_tokens)
        except HstapError as exc:
            raise ApiError(400, str(exc), "messages", "context_length_exceeded") from None
        self.future.add_done_callback(lambda _: self._post(None))

    def _post(self, item: list[int] | None) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            return False
        return True

    def _on_tokens(self, tokens: list[int]) -> bool:
        """Called on the engine's worker thread: False once the client left or a stop string ended the answer."""
        return not self.gone and self._post(tokens)

    def stop(self) -> None:
        """Nobody wants the rest: the engine frees the row at its next host read (or never starts it)."""
        self.gone = True
        self.future.cancel()

    async def deltas(self) -> AsyncIterator[str]:
        """The answer's text as it becomes final, up to a stop string; raises what decoding raised."""
        while (tokens := await self.queue.get()) is not None:
            if delta := self.text.push(tokens):
                yield delta
            if self.text.stopped:
                self.stop()
                return
        self.generation = self.future.result()
        if tail := self.text.flush():
            yield tail

    def outcome(self) -> tuple[str, dict]:
        """finish_reason and usage, once `deltas` is exhausted (a stop string counts the tokens up to its end)."""
        if self.text.stopped:
            reason, completion = "stop", self.text.used
        else:
            reason, completion = self.generation.finish_reason, self.generation.completion_tokens
        return reason, {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                        "total_tokens": self.prompt_tokens + completion}


def start_chat(engine: Engine, req: ChatRequest, model_name: str, default_max_tokens: int) -> Answer:
    """Check a chat request and queue it; an ApiError for anything the client must change."""
    if req.model is not None and req.model != model_name:
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model_name!r}", "model",
                       "model_not_found")
    refuse_unsupported(req)
    messages = [m.model_dump() for m in req.messages]
    problem = message_problem(messages)
    if problem is not None or messages[-1]["role"] != "user":
        raise ApiError(400, f"messages: {problem or 'the last message must be from the user'}", "messages",
                       "bad_messages")
    tokenizer = engine.tokenizer
    request = Request(prompt=render_prompt(messages, tokenizer), max_new_tokens=max_new_tokens(req, default_max_tokens),
                      temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0,
                      seed=req.seed)
    return Answer(engine, request, TextStream(tokenizer, req.stop or []))


def _head(model_name: str, kind: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}


def _count(served: dict, usage: dict) -> None:
    served["requests"] += 1
    served["completion_tokens"] += usage["completion_tokens"]


async def complete_chat(answer: Answer, model_name: str, served: dict) -> dict:
    """The whole answer as one chat.completion."""
    try:
        content = "".join([delta async for delta in answer.deltas()])
    except Exception as exc:
        raise ApiError(500, f"decoding failed: {type(exc).__name__}: {exc}", code="server_error") from exc
    reason, usage = answer.outcome()
    _count(served, usage)
    return {**_head(model_name, "chat.completion"), "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}]}


async def chat_chunks(answer: Answer, model_name: str, include_usage: bool, served: dict) -> AsyncIterator[dict]:
    """OpenAI's chat.completion.chunk events: the role, the text as it comes, the finish_reason, the usage."""
    head = _head(model_name, "chat.completion.chunk")

    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for delta in answer.deltas():
            yield chunk({"content": delta})
    except Exception as exc:  # noqa: BLE001 -- decoding failed mid-answer: an error event (clients raise it), the end
        yield ApiError(500, f"decoding failed: {type(exc).__name__}: {exc}", code="server_error").body()
        return
    reason, usage = answer.outcome()
    _count(served, usage)
    yield chunk({}, reason)
    if include_usage:
        yield {**head, "choices": [], "usage": usage}


async def server_sent(answer: Answer, events: AsyncIterator[dict], served: dict) -> AsyncIterator[str]:
    """`events` as server-sent events ending in `[DONE]`; a client that leaves first stops the answer."""
    ended = False
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        ended = True
        yield "data: [DONE]\n\n"
    finally:  # a disconnect cancels this generator at its `yield` (or at the wait for the next tokens)
        if not ended:
            answer.stop()
            served["disconnected"] += 1


def create_app(target, model_name: str, max_batch: int, default_max_tokens: int = 256, drafter=None,
               draft: str | None = None, prefill: str = "lean") -> FastAPI:
    """A FastAPI app answering as `model_name` with `target` (a `hstap.models.Target`); `drafter` (an
    Eagle3Drafter on the target's device) and/or `draft` (a draft shape) turn on speculative decoding. `prefill`:
    the runtime's prefill path ("lean", or "model" when hooks on the model must see the prompts: hf_capture)."""
    engine = Engine(target, max_batch=max_batch, drafter=drafter, draft=draft, prefill=prefill)
    served = {"requests": 0, "completion_tokens": 0, "disconnected": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="hstap hf server", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        """Totals since start; `batching` (requests decoding now, the most decoded together, rows freed early by
        a stop string or a client that left); `speculative` (None without a drafter) holds τ."""
        return {**served, "batching": engine.batch_stats(),
                "speculative": engine.spec_stats() if engine.spec is not None else None}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hstap"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        answer = start_chat(engine, req, model_name, default_max_tokens)
        if not req.stream:
            return await complete_chat(answer, model_name, served)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = chat_chunks(answer, model_name, include_usage, served)
        return StreamingResponse(server_sent(answer, events, served), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
