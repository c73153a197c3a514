"""Capture taps for a transformers model served by hstap's own `hf` engine (`hstap serve --engine hf`).

The hooks feed the same `EngineSession` the SGLang and vLLM adapters use: a forward pre-hook reads the left-padded
`[B, P]` prefill (decode steps are `[B, 1]` and pass untouched), the decoder layers' outputs are the canonical
residual streams, `model.norm` gives the teacher. Identity, stitching and the store are the engine rules
(`hstap.capture.engine_session`), so this path is the CPU stand-in for a GPU engine.

A hook that has not fired once in the first `hooks.SILENT_AFTER` prefill requests (a module the model calls through
`.forward()`) is reported in one line on stderr, `hstap capture: error: ...`, which `hstap serve` stops on.
"""

from __future__ import annotations

import sys

import torch

from hstap.capture.engine_session import EngineSession, Span
from hstap.capture.hf import text_decoder
from hstap.capture.hooks import Fired, first_tensor, module_names, never_raise
from hstap.store.names import hidden_name


class HfEngineTaps:
    """Hooks on a transformers causal LM served by `hstap.runtime.engine.Engine`; `remove()` takes them off."""

    def __init__(self, model: torch.nn.Module, session: EngineSession, layers: list[int]) -> None:
        self.session = session
        guard = never_raise(session.error)
        decoder = text_decoder(model)
        self.fired = Fired(module_names(model, {**{hidden_name(k): decoder.layers[k] for k in layers},
                                                "teacher": decoder.norm}))
        self.silent_reported = False
        self.handles = [model.register_forward_pre_hook(guard(self._pre_hook), with_kwargs=True)]
        self.handles += [decoder.layers[k].register_forward_hook(guard(self._layer_hook(k))) for k in layers]
        self.handles.append(decoder.norm.register_forward_hook(guard(self._norm_hook)))

    def _check_fired(self) -> None:
        """Once: name the hooks that have not fired in the first SILENT_AFTER prefill requests."""
        if not self.silent_reported and (silent := self.fired.silent()):
            self.silent_reported = True
            message = self.fired.message(silent)
            self.session.error(RuntimeError(message))
            print(f"hstap capture: error: {message}", file=sys.stderr, flush=True)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre_hook(self, module, args, kwargs) -> None:
        session = self.session
        if session.active():
            session.tap.end()
        self._check_fired()
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if ids is None or ids.dim() != 2 or ids.shape[1] <= 1:
            session.skip("decode")
            return
        if mask is None:
            mask = torch.ones_like(ids)
        lengths = mask.sum(-1).tolist()  # the one host read, before the forward
        width = ids.shape[1]
        left = bool(mask[:, -1].all()) if ids.shape[0] else True
        spans = [Span(start=width - n if left else 0, length=int(n), row=b) for b, n in enumerate(lengths) if n]
        self.fired.requests += len(spans)
        if spans:
            session.begin(spans)
            session.record("input_ids", ids[..., None])  # (B, P, 1): gathered like the hidden states

    def _layer_hook(self, k: int):
        name = hidden_name(k)

        def hook(module, args, output) -> None:
            self.fired.hit(name)
            if self.session.active():
                self.session.record(name, first_tensor(output))
        return hook

    def _norm_hook(self, module, args, output) -> None:
        self.fired.hit("teacher")
        if self.session.active():
            self.session.record("teacher", output)
