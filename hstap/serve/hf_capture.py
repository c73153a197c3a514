"""The `hf` engine with capture: hstap's OpenAI-compatible server (`hf_server.create_app`) plus the taps.

    python -m hstap.serve.hf_capture --model smollm2 --port 8000 --capture-layers auto --capture-dir runs/hfcap
    hstap capture-remote --url http://127.0.0.1:8000 --data jsonl:synth.jsonl --capture-dir runs/hfcap

`hstap serve --engine hf` runs this. It adds two things to the app, and changes nothing in it:
- `POST /v1/completions` with a token-id `prompt` (the OpenAI shape SGLang and vLLM also accept), which the
  capture client uses to prefill a whole rendered conversation (`max_tokens: 1`); it answers the decoded text and
  its `token_ids`, refuses `stream` and `stop` (stream and stop through `/v1/chat/completions`), and errors in
  OpenAI's shape like the chat route;
- read-only hooks on the served model feeding the same `EngineSession` the SGLang and vLLM adapters use: a
  forward pre-hook reads the left-padded `[B, P]` prefill (decode steps are `[B, 1]` and pass untouched), the
  decoder layers' outputs are the canonical residual streams, `model.norm` gives the teacher. Identity,
  stitching and the store are the engine rules (`hstap.capture.engine_session`), so this path is the CPU stand-in for a
  GPU engine. Reading the padding mask's lengths is the one host read, before the forward starts.

Start-up runs in phases the supervisor's watchdog follows from the log: loading, then a warm-up generation (before
the taps go on, so it is never captured), then serving. The fault switch can hang each phase (`HSTAP_FAULT=
hang-loading`, `hang-warmup`, `hang-first-request`), and SIGUSR2 dumps every thread's stack when the supervisor
asked for it (`hstap.serve.stacks`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from hstap.errors import HstapError
from hstap.faults import fault_point
from hstap.serve.openai_api import ApiError, OpenAIParams, refuse_unsupported

if TYPE_CHECKING:  # torch comes in with the model, after the "loading" line: start-up hangs are told apart
    from hstap.capture.engine_session import EngineCaptureConfig


class CompletionRequest(OpenAIParams):
    """The subset of OpenAI's completions request used to prefill token ids."""

    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=1, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, value: Any) -> Any:
        if isinstance(value, str):  # pydantic reports a ValueError as the field's error (a TypeError escapes)
            raise ValueError(  # noqa: TRY004
                "expected a list of token ids: this route prefills token-id prompts for capture; send text as "
                "messages to /v1/chat/completions")
        return value


def _refuse_text_features(req: CompletionRequest, model_name: str) -> None:
    """What this capture route does not do, as OpenAI-shaped errors rather than silently ignored fields."""
    if req.model is not None and req.model != model_name:
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model_name!r}", "model",
                       "model_not_found")
    refuse_unsupported(req)
    for name in ("stream", "stop"):
        if getattr(req, name):
            raise ApiError(400, f"{name}: not supported on /v1/completions (token-id prefill for capture); use "
                                "/v1/chat/completions", name, "unsupported_parameter")


def add_completions(app, model_name: str) -> None:
    """Add `POST /v1/completions` (token-id prompts) to an `hf_server` app, using its batching engine."""
    from hstap.runtime.engine import Request

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        fault_point("hang-first-request")
        _refuse_text_features(req, model_name)
        engine = app.state.engine
        try:
            future = engine.submit(Request(prompt=list(req.prompt), max_new_tokens=req.max_tokens,
                                           temperature=req.temperature))
        except HstapError as exc:
            raise ApiError(503 if engine.closed else 400, str(exc), "prompt") from None
        gen = await asyncio.wrap_future(future)
        text = engine.tokenizer.decode(gen.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [{"index": 0, "text": text, "token_ids": gen.tokens,
                                                  "finish_reason": gen.finish_reason}],
                "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                          "total_tokens": gen.prompt_tokens + gen.completion_tokens}}


def warm_up(app) -> None:
    """One short generation through the app's engine (kernels, caches, CUDA graphs), before any tap is on."""
    from hstap.data import render_prompt
    from hstap.runtime.engine import Request

    print("hstap hf engine: warm-up: one short generation", flush=True)
    fault_point("hang-warmup")
    prompt = render_prompt([{"role": "user", "content": "Hi"}], app.state.engine.tokenizer)
    app.state.engine.generate([Request(prompt=prompt, max_new_tokens=2)])


def create_capture_app(target, model_name: str, cfg: EngineCaptureConfig | None, max_batch: int, drafter=None,
                       draft: str | None = None, warmup: bool = False, prefill: str = "model"):
    """`hf_server.create_app` plus `/v1/completions`, and the taps when `cfg` is given (they read prefill only, so
    they work with speculative decoding too); `warmup` runs `warm_up` first.

    `prefill` is the runtime's prefill path: "model" by default, because the taps are hooks on the transformers
    model and the runtime's lean prefill never calls it (taps may also be put on later, as the tests do); `main`
    passes "lean" only when it serves without capture, where nothing hooks the model."""
    from hstap.capture.engine_session import session_for
    from hstap.capture.hf_engine import HfEngineTaps
    from hstap.serve.hf_server import create_app

    app = create_app(target, model_name, max_batch=max_batch, drafter=drafter, draft=draft, prefill=prefill)
    add_completions(app, model_name)
    if warmup:
        warm_up(app)
    if cfg is not None:
        app.state.taps = HfEngineTaps(target.model, session_for(cfg), cfg.layers)
    return app


def main(argv: list[str] | None = None) -> None:
    from hstap.config import add_config_flags, config_from_args
    from hstap.serve.config import HfServerConfig
    from hstap.serve.stacks import enable_stack_dumps

    enable_stack_dumps()
    parser = argparse.ArgumentParser(prog="python -m hstap.serve.hf_capture", description=__doc__.splitlines()[0])
    add_config_flags(parser, HfServerConfig, "hf-server")
    try:
        args = config_from_args(parser.parse_args(argv))
        print(f"hstap hf engine: loading {args.model}", flush=True)
        fault_point("hang-loading")
        import uvicorn

        from hstap.capture.engine_session import EngineCaptureConfig
        from hstap.models import load_target

        target = load_target(args.model, device=args.device)
        cfg = None
        if args.capture_dir is not None:
            cfg = EngineCaptureConfig.for_checkpoint(args.model, args.capture_layers or "auto", args.capture_dir,
                                                     "hf", dtype=args.dtype)
            print(f"hstap hf engine: capturing layers {cfg.layers} into {cfg.out}", flush=True)
        drafter = None
        if args.drafter is not None:
            from hstap.drafter.load import load_drafter

            drafter = load_drafter(args.drafter, target)
            print(f"hstap hf engine: speculative decoding, {args.draft or 'chain:3'} from {args.drafter}", flush=True)
        name = args.name or target.model_id
        app = create_capture_app(target, name, cfg, max_batch=args.max_batch, drafter=drafter, draft=args.draft,
                                 warmup=True, prefill="model" if cfg is not None else "lean")
    except HstapError as exc:
        sys.exit(f"hstap hf engine: error: {exc}")
    print(f"hstap hf engine: warm-up done, serving {name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
