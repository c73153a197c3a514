"""An OpenAI-compatible chat server over a transformers target: what `hstap synth --server` and tests talk to.

    python -m hstap.serve.hf_capture --model smollm2 --port 8000 [--host 127.0.0.1] [--name NAME] [--max-batch 8]
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0}'

Endpoints: `POST /v1/chat/completions` (messages, max_tokens, temperature, top_p, seed; no streaming, n = 1),
`GET /v1/models`, `GET /health`, `GET /metrics` (requests served; with a drafter the speculative totals and τ). Prompts are rendered with `hstap.data.render_prompt`, i.e. token for token as
capture renders them. Requests are decoded together by `hstap.runtime.engine.Engine` (up to `max_batch` rows;
CUDA graphs on a GPU): on a CPU a request starts as soon as a row is free (continuous batching), on CUDA (where
static batches measured faster) and speculatively (a drafter or an `ngram:K` draft) in the next batch: greedy
answers are the same tokens either way, speculative ones only faster.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from hstap.data.checks import message_problem
from hstap.data.render import render_prompt
from hstap.errors import HstapError
from hstap.runtime.engine import Engine, Request


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat request this server honours; unknown fields are ignored, as OpenAI's are."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: Literal[False] = False


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error",
                                                                "code": code}})


def create_app(target, model_name: str, max_batch: int = 8, default_max_tokens: int = 256, drafter=None,
               draft: str | None = None, prefill: str = "lean") -> FastAPI:
    """A FastAPI app answering as `model_name` with `target` (a `hstap.models.Target`); `drafter` (an
    Eagle3Drafter on the target's device) and/or `draft` (a draft shape) turn on speculative decoding. `prefill`:
    the runtime's prefill path ("lean", or "model" when hooks on the model must see the prompts: hf_capture)."""
    engine = Engine(target, max_batch=max_batch, drafter=drafter, draft=draft, prefill=prefill)
    served = {"requests": 0, "completion_tokens": 0}
    tokenizer = target.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="hstap hf server", lifespan=lifespan)
    app.state.engine = engine

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        """Totals since start; `speculative` (None without a drafter) holds τ = tokens per verification."""
        return {**served, "speculative": engine.spec_stats() if engine.spec is not None else None}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hstap"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if req.model is not None and req.model != model_name:
            return _error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                          "model_not_found")
        messages = [m.model_dump() for m in req.messages]
        problem = message_problem(messages)
        if problem is not None or messages[-1]["role"] != "user":
            return _error(400, f"messages: {problem or 'the last message must be from the user'}", "bad_messages")
        max_new = req.max_completion_tokens or req.max_tokens or default_max_tokens
        request = Request(prompt=render_prompt(messages, tokenizer), max_new_tokens=max_new,
                          temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        try:
            future = engine.submit(request)
        except HstapError as exc:
            return _error(400, str(exc), "context_length_exceeded")
        gen = await asyncio.wrap_future(future)
        text = tokenizer.decode(gen.tokens, skip_special_tokens=False)
        served["requests"] += 1
        served["completion_tokens"] += gen.completion_tokens
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": gen.finish_reason}],
            "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                      "total_tokens": gen.prompt_tokens + gen.completion_tokens},
        }

    return app
