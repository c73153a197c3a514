"""The lean prefill (`Runtime(prefill="lean")`, LeanLlama's forward writing the cache in place) against
transformers' own (`prefill="model"`) on the real SmolLM2 in fp32: next-token logits, every layer's keys and values
over the real columns, the drafter's aux states, start/write_at; `admit` into some rows of a busy slot; and which
path hooks on the model see. Short left-padded prompts keep the file at a few seconds."""

from __future__ import annotations

import pytest
import torch

from hstap.runtime.decode import left_pad
from hstap.runtime.target import Runtime, consecutive_runs

AUX = [1, 14, 26]
LENGTHS = (13, 6, 9)  # different lengths: rows 1 and 2 are left-padded
# Rows that are not neighbours in the slot (admit into rows 0 and 2) are prefilled by the lean path one slice of
# the cache at a time, i.e. one-row forwards where transformers runs one two-row forward: other GEMM blocking, so
# fp32 rounding through 30 layers moves a logit of ~30 by up to ~6e-5 (this CPU, 2 cores). A row written into the
# wrong place, a wrong mask or position differs by O(1e-1) and more.
SPLIT_TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def batch(target, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Three real MT-bench prompts cut to LENGTHS tokens, left-padded to (3, 13)."""
    return left_pad([p[:n] for p, n in zip(prompts, LENGTHS)], target.tokenizer.pad_token_id, "cpu")


def _prefilled(target, path: str, ids: torch.Tensor, mask: torch.Tensor) -> tuple[Runtime, torch.Tensor, torch.Tensor]:
    """A runtime of 4 rows (one dummy row) after prefilling the batch by `path`; → (runtime, logits, aux)."""
    rt = Runtime(target.model, batch_size=4, max_len=64, cuda_graphs=False, len_bucket=32, prefill=path)
    logits, aux = rt.prefill(ids, mask, 8, aux_layers=AUX)
    return rt, logits, aux


@pytest.fixture(scope="module")
def both(target, batch) -> dict[str, tuple[Runtime, torch.Tensor, torch.Tensor]]:
    return {path: _prefilled(target, path, *batch) for path in ("model", "lean")}


def test_lean_prefill_equals_transformers_prefill(both, batch):
    """fp32, within the tolerance of another summation order (the output projection sums its heads in the grouped
    order, attention.grouped_o: logits move by ≤ 7e-5). Ignoring the padding mask moves the padded rows' logits by
    ~9-18, so this fails if padding keys were attended to or positions counted the padding."""
    ids, mask = batch
    (model_rt, model_logits, model_aux), (lean_rt, lean_logits, lean_aux) = both["model"], both["lean"]
    width = ids.shape[1]
    torch.testing.assert_close(lean_logits, model_logits, **SPLIT_TOL)
    starts = [width - n for n in LENGTHS]
    assert lean_rt.slot.start[:3].tolist() == model_rt.slot.start[:3].tolist() == starts
    assert lean_rt.slot.write_at.tolist() == model_rt.slot.write_at.tolist() == [width] * 4
    assert lean_rt.slot.bound == model_rt.slot.bound == width
    for row, start in enumerate(starts):  # real columns only: padding columns are never read
        torch.testing.assert_close(lean_rt.slot.kv.data[:, row, :, start:width],
                                   model_rt.slot.kv.data[:, row, :, start:width], **SPLIT_TOL)
        torch.testing.assert_close(lean_aux[row, start:], model_aux[row, start:], **SPLIT_TOL)
    assert lean_aux.shape == model_aux.shape == (3, width, len(AUX) * lean_rt.lean.layers[0].ln1.shape[0])
    assert not lean_rt.slot.kv.data[:, 3].any(), "the dummy row is not written"


def test_admit_writes_only_its_rows_and_equals_transformers(target, batch):
    """Rows 3 and 1 are admitted first (two runs of one row), then rows 0 and 2 beside them: rows 3 and 1 keep
    their cache and positions bit for bit, and every row equals what transformers' prefill admits."""
    ids, mask = batch
    slots = {}
    for path in ("model", "lean"):
        rt = Runtime(target.model, batch_size=4, max_len=64, cuda_graphs=False, len_bucket=32, prefill=path)
        rt.open_slot(32)
        first = rt.admit([3, 1], ids[:2, 7:], mask[:2, 7:])  # (2, 6): row 1 of the batch is unpadded here
        kept = rt.slot.kv.data[:, [3, 1]].clone(), rt.slot.start.clone(), rt.slot.write_at.clone()
        second = rt.admit([0, 2], ids[1:], mask[1:])  # (2, 13), both padded
        assert torch.equal(rt.slot.kv.data[:, [3, 1]], kept[0]), f"{path}: admitting rows 0, 2 wrote rows 3, 1"
        assert rt.slot.start[[3, 1]].tolist() == kept[1][[3, 1]].tolist() == [0, 0]
        assert rt.slot.write_at.tolist() == [13, 6, 13, 6] and rt.slot.start[[0, 2]].tolist() == [7, 4]
        slots[path] = first, second, rt.slot.kv.data.clone()
    lean, model = slots["lean"], slots["model"]
    torch.testing.assert_close(lean[0], model[0], **SPLIT_TOL)
    torch.testing.assert_close(lean[1], model[1], **SPLIT_TOL)
    for row, (start, end) in {3: (0, 6), 1: (0, 6), 0: (7, 13), 2: (4, 13)}.items():
        torch.testing.assert_close(lean[2][:, row, :, start:end], model[2][:, row, :, start:end], **SPLIT_TOL)


def test_hooks_on_the_model_see_only_the_model_prefill(target, batch):
    """hf_capture's taps are a forward pre-hook on the model: "model" shows it the [B, P] prefill, "lean" never
    calls the model (its logits are checked above), and the hf engine's capture app asks its runtime for "model"
    (taps may go on after the app is made, as tests/serve/test_hf_capture.py puts them)."""
    from hstap.serve.hf_capture import create_capture_app

    ids, mask = batch
    seen = []
    handle = target.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape),
                                                    with_kwargs=True)
    try:
        for path in ("model", "lean"):
            seen.clear()
            Runtime(target.model, batch_size=3, max_len=64, cuda_graphs=False, len_bucket=32,
                    prefill=path).prefill(ids, mask, 4)
            assert seen == ([ids.shape] if path == "model" else []), path
    finally:
        handle.remove()
    app = create_capture_app(target, "smollm2", None, max_batch=1)
    try:
        assert app.state.engine.stepper.prefill_path == "model"
    finally:
        app.state.engine.close()


def test_bad_prefill_path_is_one_line(target):
    with pytest.raises(ValueError, match="prefill must be one of lean, model, got 'fast'"):
        Runtime(target.model, batch_size=1, max_len=64, prefill="fast")


@pytest.mark.parametrize("rows, runs", [
    ([0, 1, 2], [(0, 3)]), ([4, 5, 6, 0, 1], [(0, 3), (3, 5)]), ([3, 1], [(0, 1), (1, 2)]), ([2], [(0, 1)]),
    ([], []),
])
def test_consecutive_runs(rows, runs):
    assert consecutive_runs(rows) == runs
