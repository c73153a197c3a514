"""The `hf` engine with capture: hstap's OpenAI-compatible server (`hf_server.create_app`) plus the taps.

    python -m hstap.serve.hf_capture --model smollm2 --port 8000 --capture-layers auto --capture-dir runs/hfcap
    hstap capture-remote --url http://127.0.0.1:8000 --data jsonl:synth.jsonl --capture-dir runs/hfcap

`hstap serve --engine hf` runs this. It adds two things to the app, and changes nothing in it:
- `POST /v1/completions` with a token-id `prompt` (the OpenAI shape SGLang and vLLM also accept), which the
  capture client uses to prefill a whole rendered conversation (`max_tokens: 1`);
- read-only hooks on the served model feeding the same `EngineSession` the SGLang and vLLM adapters use: a
  forward pre-hook reads the left-padded `[B, P]` prefill (decode steps are `[B, 1]` and pass untouched), the
  decoder layers' outputs are the canonical residual streams, `model.norm` gives the teacher. Identity,
  stitching and the store are the engine rules (`hstap.capture.engine`), so this path is the CPU stand-in for a
  GPU engine. Reading the padding mask's lengths is the one host read, before the forward starts.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from hstap.capture.engine import EngineCaptureConfig, EngineSession, Span, session_for


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completions request used to prefill token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=1, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


def add_completions(app, model_name: str) -> None:
    """Add `POST /v1/completions` (token-id prompts) to an `hf_server` app, using its batching engine."""
    from hstap.serve.hf_server import _error
    from hstap.synth.embedded import Request

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.model is not None and req.model != model_name:
            return _error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                          "model_not_found")
        future = app.state.engine.submit(Request(prompt=list(req.prompt), max_new_tokens=req.max_tokens,
                                                 temperature=req.temperature))
        gen = await asyncio.wrap_future(future)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [{"index": 0, "text": "", "token_ids": gen.tokens,
                                                  "finish_reason": gen.finish_reason}],
                "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                          "total_tokens": gen.prompt_tokens + gen.completion_tokens}}


class HfEngineTaps:
    """Hooks on a transformers causal LM served by `hstap.synth.embedded.Engine`; `remove()` takes them off."""

    def __init__(self, model: torch.nn.Module, session: EngineSession, layers: list[int]) -> None:
        from hstap.capture.hf import text_decoder

        self.session = session
        decoder = text_decoder(model)
        self.handles = [model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)]
        self.handles += [decoder.layers[k].register_forward_hook(self._layer_hook(k)) for k in layers]
        self.handles.append(decoder.norm.register_forward_hook(self._norm_hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre_hook(self, module, args, kwargs) -> None:
        try:
            session = self.session
            if session.active():
                session.tap.end()
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if ids is None or ids.dim() != 2 or ids.shape[1] <= 1:
                session.skip("decode")
                return None
            if mask is None:
                mask = torch.ones_like(ids)
            lengths = mask.sum(-1).tolist()  # the one host read, before the forward
            width = ids.shape[1]
            left = bool(mask[:, -1].all()) if ids.shape[0] else True
            spans = [Span(start=width - n if left else 0, length=int(n), row=b) for b, n in enumerate(lengths) if n]
            if spans:
                session.begin(spans)
                session.record("input_ids", ids[..., None])  # (B, P, 1): gathered like the hidden states
        except Exception as exc:  # noqa: BLE001 — never raise into the forward
            self.session.error(exc)
        return None

    def _layer_hook(self, k: int):
        def hook(module, args, output) -> None:
            try:
                if self.session.active():
                    self.session.record(f"hidden.{k}", output[0] if isinstance(output, (tuple, list)) else output)
            except Exception as exc:  # noqa: BLE001
                self.session.error(exc)
            return None
        return hook

    def _norm_hook(self, module, args, output) -> None:
        try:
            if self.session.active():
                self.session.record("teacher", output)
        except Exception as exc:  # noqa: BLE001
            self.session.error(exc)
        return None


def create_capture_app(target, model_name: str, cfg: EngineCaptureConfig | None, max_batch: int = 8):
    """`hf_server.create_app` plus `/v1/completions`, and the taps when `cfg` is given."""
    from hstap.serve.hf_server import create_app

    app = create_app(target, model_name, max_batch=max_batch)
    add_completions(app, model_name)
    if cfg is not None:
        app.state.taps = HfEngineTaps(target.model, session_for(cfg), cfg.layers)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from hstap.capture.engine import EngineCaptureConfig
    from hstap.models import load_target

    ap = argparse.ArgumentParser(prog="python -m hstap.serve.hf_capture", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default=None, help="model id to serve as (default: the target's model id)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--capture-layers", default=None, help="'auto' or canonical ids; omit to serve without taps")
    ap.add_argument("--capture-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    args = ap.parse_args(argv)
    print(f"hstap hf engine: loading {args.model}", flush=True)
    target = load_target(args.model, device=args.device)
    cfg = None
    if args.capture_dir is not None:
        cfg = EngineCaptureConfig.for_checkpoint(args.model, args.capture_layers or "auto", args.capture_dir, "hf",
                                                 args.dtype)
        print(f"hstap hf engine: capturing layers {cfg.layers} into {cfg.out}", flush=True)
    name = args.name or target.model_id
    app = create_capture_app(target, name, cfg, max_batch=args.max_batch)
    print(f"hstap hf engine: warmup done, serving {name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
