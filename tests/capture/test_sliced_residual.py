"""A residual sliced across ranks reaches the writer with fewer rows than its forward: counted, never stored.

SGLang 0.5.23 hands the next layer's input norm each rank's attention-TP slice when an a2a MoE runs on the slice
(`--moe-a2a-backend` with attention TP > 1: srt/layers/layer_boundary/factories.py:262-267, boundary.py:582-612);
`hstap serve` refuses the flags that always slice (`--enable-attn-tp-input-scattered`, `--enable-layernorm-sp`) but
not that one. What the writer rank then gets is a tensor shorter than the packed batch; a gather past its end would
be a device-side assert that kills the engine, so the session checks the row count on the host.
"""

from __future__ import annotations

import json

import torch

from hstap.capture.engine_session import REQUESTS_NAME, EngineCaptureConfig, EngineSession, Span
from hstap.store import open_store


def _forward(session: EngineSession, ids: list[int], rows: int, hidden: int) -> None:
    """One packed prefill of a single request, as the SGLang adapter's hooks hand it over, every tensor `rows` long."""
    session.begin([Span(start=0, length=len(ids))], total=len(ids))
    session.record("input_ids", torch.tensor(ids))
    for name in [*(f"hidden.{k}" for k in session.cfg.layers), "teacher"]:
        if session.active():  # as every hook site does: a dropped forward records nothing more
            session.record(name, torch.randn(rows, hidden))


def test_a_forward_whose_residual_is_sliced_is_an_error_and_stores_nothing(tmp_path):
    cfg = EngineCaptureConfig.for_checkpoint("smollm2", "1,14,26", tmp_path / "cap", "sglang", dtype="fp32")
    whole, sliced = list(range(100, 116)), list(range(200, 216))
    (tmp_path / "cap").mkdir()
    with open(tmp_path / "cap" / REQUESTS_NAME, "w") as f:
        for name, ids in (("whole", whole), ("sliced", sliced)):
            f.write(json.dumps({"id": name, "input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    session = EngineSession(cfg)
    _forward(session, whole, len(whole), cfg.hidden_size)  # every row on the writer: stored
    _forward(session, sliced, len(sliced) // 8, cfg.hidden_size)  # tp 8: the writer holds 1/8 of the rows
    report = session.close()
    assert report["dropped_samples"] == 1 and "sliced across ranks" in report["first_error"], report
    assert report["captured"] == 1, report
    assert open_store(tmp_path / "cap").ids() == ["whole"]
