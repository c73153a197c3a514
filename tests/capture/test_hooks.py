"""Hooks that never fire: a model that calls its decoder layers through `.forward()` (SGLang issue 21686,
NemotronH) makes the embedded capture stop in one line after the first requests, with nothing stored."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from hstap.capture.hf import text_decoder
from hstap.capture.hooks import SILENT_AFTER
from hstap.capture.run import prefill_with_tap
from hstap.config import TeacherSpec
from hstap.data import RenderedSample
from hstap.errors import HstapError


@contextmanager
def layers_called_through_forward(model: torch.nn.Module):
    """Make the model call each decoder layer as `layer.forward(...)`: `nn.Module.__call__`, and with it every
    forward hook on the layer, is bypassed — what NemotronH's SGLang model does. Restored on exit."""
    layers = text_decoder(model).layers
    cls = type(layers[0])
    direct = type(f"Direct{cls.__name__}", (cls,), {"__call__": lambda self, *a, **kw: self.forward(*a, **kw)})
    for layer in layers:
        layer.__class__ = direct
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = cls


def _samples(tokenizer, n: int) -> list[RenderedSample]:
    texts = [f"Question {i}: what is {i} plus {i}?" for i in range(n)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [RenderedSample(id=f"s{i}", input_ids=x, loss_mask=[True] * len(x)) for i, x in enumerate(ids)]


def test_the_bypass_is_real_and_changes_no_output(target):
    ids = torch.tensor([target.tokenizer("Hello there", add_special_tokens=False)["input_ids"]])
    fired = []
    handle = text_decoder(target.model).layers[1].register_forward_hook(lambda *a: fired.append(1))
    try:
        with torch.inference_mode():
            plain = target.model(input_ids=ids).logits
            with layers_called_through_forward(target.model):
                bypassed = target.model(input_ids=ids).logits
    finally:
        handle.remove()
    assert len(fired) == 1 and torch.equal(plain, bypassed)  # the hook ran for the plain forward only


@pytest.mark.parametrize("n, batch_tokens", [(SILENT_AFTER + 4, 64), (3, 4096)])
def test_embedded_capture_stops_when_its_layer_hooks_never_fire(target, n, batch_tokens):
    """Many requests: stopped after the first SILENT_AFTER, not at the end. Fewer: stopped when they are done.
    Either way nothing reached the store, and the message names the modules and the cause."""
    stored = []
    with layers_called_through_forward(target.model), pytest.raises(HstapError) as info:
        prefill_with_tap(target, _samples(target.tokenizer, n), [1, 14, 26], TeacherSpec(kind="hidden", k=0),
                         lambda sid, t: stored.append(sid), dtype="bf16", batch_tokens=batch_tokens, device="cpu",
                         progress=False)
    message = str(info.value)
    assert "\n" not in message and not stored
    head = ("the capture hooks on model.layers.1 (hidden.1), model.layers.14 (hidden.14), model.layers.26 "
            "(hidden.26) never fired in ")
    assert message.startswith(head), message
    requests = int(message[len(head):].split()[0])
    assert (SILENT_AFTER <= requests < n) if n > SILENT_AFTER else requests == n, message
    assert "calls these modules' .forward() directly" in message and "model.norm" not in message
