"""The `hf` engine's taps under faults, in process on the real SmolLM2: an exception inside a tap during a forward
(HSTAP_FAULT=raise-in-tap), and layer hooks that never fire (a model calling its layers through `.forward()`)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from hstap import faults
from hstap.capture.engine_session import REPORT_NAME, EngineCaptureConfig, session_for
from hstap.capture.hf_engine import HfEngineTaps
from hstap.capture.hooks import SILENT_AFTER
from hstap.capture.remote import announce
from hstap.data import SkipReport, render_all
from hstap.serve.hf_capture import create_capture_app
from hstap.store import open_store
from tests.capture.test_hooks import layers_called_through_forward
from tests.capture.test_remote import CONVERSATIONS
from tests.serve.test_hf_server import NAME, _Client


@pytest.fixture(scope="module")
def served(target):
    """The hf engine's app without taps, shared: each test puts its own taps (and store) on the served model."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core test machine: one intra-op thread runs far faster under load
    app = create_capture_app(target, NAME, None, max_batch=2)
    yield _Client(app)
    app.state.engine.close()
    torch.set_num_threads(before)


@contextmanager
def taps(target, out):
    """The taps `create_capture_app` installs for `--capture-dir out`; yields the session's final counters dict,
    filled once the taps are off and the session closed."""
    cfg = EngineCaptureConfig(out=out, layers=[1, 14, 26], num_layers=target.num_layers, hidden_size=target.hidden_size,
                              model_id=target.model_id, fingerprint=target.fingerprint, engine="hf", flush_s=0.2)
    hooks = HfEngineTaps(target.model, session_for(cfg), cfg.layers)
    report: dict = {}
    try:
        yield report
    finally:
        hooks.remove()
        report.update(hooks.session.close())


def test_an_exception_inside_a_tap_costs_that_sample_only(tmp_path, target, served, monkeypatch):
    """The 2nd guarded hook call (layer 1's, in the first request's prefill) raises. The answer is the plain
    model's, the server answers the next request, whose sample is stored; the broken one is counted, not stored
    in part; and a forward with a raising tap returns logits bit for bit equal to the untapped model's."""
    data = tmp_path / "conv.jsonl"
    data.write_text(CONVERSATIONS)
    samples = render_all(f"jsonl:{data}", target.tokenizer, SkipReport(), max_tokens=256)
    with torch.inference_mode():
        plain = [target.model(input_ids=torch.tensor([s.input_ids])).logits[0, -1] for s in samples]  # (V,)
    monkeypatch.setenv(faults.ENV, "raise-in-tap:2")
    monkeypatch.setattr(faults, "_passes", {})
    with taps(target, tmp_path / "cap") as report:
        announce(tmp_path / "cap", samples)
        for sample, logits in zip(samples, plain):
            r = served.post("/v1/completions", json={"prompt": sample.input_ids, "max_tokens": 1})
            assert r.status_code == 200, r.text
            first = int(logits.argmax())
            assert r.json()["choices"][0]["token_ids"] == ([] if first in target.stop_ids else [first])
        monkeypatch.setattr(faults, "_passes", {})  # arm it again for a direct forward
        ids = torch.tensor([target.tokenizer("An unannounced prompt.", add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            tapped = target.model(input_ids=ids).logits
        assert faults._passes["raise-in-tap"] >= 2  # it did raise inside this forward
    with torch.inference_mode():
        assert torch.equal(tapped, target.model(input_ids=ids).logits)
    store = open_store(tmp_path / "cap")
    assert store.ids() == [samples[1].id], store.ids()  # the first sample is not stored at all, not even in part
    assert report["captured"] == 1 and report["dropped_samples"] >= 1 and report["errors"] >= 2, report
    assert report["first_error"].startswith("InjectedFault: HSTAP_FAULT raise-in-tap:2"), report
    assert json.loads((tmp_path / "cap" / REPORT_NAME).read_text())["errors"] == report["errors"]


def test_hf_engine_hooks_that_never_fire_are_reported_in_one_line(tmp_path, target, served, capsys):
    """The served model calls its layers through `.forward()`: after SILENT_AFTER prefill requests the engine
    says so in one line (`hstap serve` stops on it) and the store stays empty."""
    out = tmp_path / "cap"
    with layers_called_through_forward(target.model), taps(target, out) as report:
        for i in range(SILENT_AFTER + 1):
            r = served.post("/v1/completions", json={"prompt": [1, 2, 3 + i], "max_tokens": 1})
            assert r.status_code == 200, r.text  # it keeps serving
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hstap capture: error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("hstap capture: error: the capture hooks on model.layers.1 (hidden.1), "
                                "model.layers.14 (hidden.14), model.layers.26 (hidden.26) never fired in "
                                f"{SILENT_AFTER} prefill requests"), errors[0]
    assert not report.get("captured") and report["prefill_requests"] == SILENT_AFTER + 1, report
    assert open_store(out).ids() == []
