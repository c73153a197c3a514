"""transformers adapter: forward hooks on the decoder layers (and lm_head / final norm for the teacher).

Hooks are registered on entry and removed on exit; they read outputs and never return a value, so the model's
outputs are untouched. They act only between `tap.begin()` and `tap.end()`, so any other use of the same model
(`generate`, evaluation) passes straight through. The context yields a `hooks.Fired`: the caller counts its prefill
requests into it and stops when a hook never fires (a module the model calls through `.forward()`).

    with hf_taps(model, tap, layer_ids=[1, 14, 26]) as fired:
        tap.begin(batch); model(input_ids=..., attention_mask=...); tap.end(); fired.requests += len(batch.ids)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from hstap.capture.hooks import Fired, first_tensor, module_names
from hstap.capture.tap import Tap
from hstap.errors import HstapError
from hstap.store.names import hidden_name


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers and the final norm: transformers' own `get_decoder()` (a multimodal
    model such as Gemma-3's keeps it at `model.language_model`), else `model.model`."""
    candidates = []
    try:
        candidates.append(model.get_decoder())
    except Exception:  # noqa: BLE001 — not every model implements it
        pass
    candidates.append(getattr(model, "model", None))
    for inner in candidates:
        if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList) and hasattr(inner, "norm"):
            return inner
    raise HstapError(f"{type(model).__name__}: no decoder with `layers` and `norm` found (get_decoder(), model.model); "
                     "this adapter supports decoder-only transformers models")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (`model.layers` for Llama, Qwen, DeepSeek, gpt-oss, …)."""
    return text_decoder(model).layers


@contextmanager
def hf_taps(model: torch.nn.Module, tap: Tap, layer_ids: list[int], teacher_kind: str = "topk") -> Iterator[Fired]:
    """Register read-only forward hooks feeding `tap`; remove them however the block exits."""
    layers = decoder_layers(model)
    modules = {hidden_name(k): layers[k] for k in layer_ids}
    modules["teacher"] = model.get_output_embeddings() if teacher_kind == "topk" else text_decoder(model).norm
    fired = Fired(module_names(model, modules))
    handles = []

    def layer_hook(name: str):
        def hook(module, args, output) -> None:
            fired.hit(name)
            if tap.active():
                tap.record(name, first_tensor(output))
        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(layer_hook(name)))
        yield fired
    finally:
        for handle in handles:
            handle.remove()
