"""The tap on the real SmolLM2: exact, non-interfering, padding-aware, and unable to break the forward."""

from __future__ import annotations

import pytest
import torch

from hstap.capture.hf import hf_taps
from hstap.capture.layers import to_hf_hidden_states_index
from hstap.capture.tap import Batch, Tap
from hstap.config import TeacherSpec

LAYERS = [1, 14, 26]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass of the target model, "
    "which is exact for greedy decoding.",
    "Hi",
]


def _padded(tokenizer, texts):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    longest = max(map(len, rows))
    ids = torch.full((len(rows), longest), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    batch = Batch(ids=[f"s{i}" for i in range(len(rows))], rows=list(range(len(rows))), starts=[0] * len(rows),
                  lengths=[len(r) for r in rows])
    return ids, mask, batch


def _capture(model, tap_dtype, ids, mask, batch, teacher=None, layers=LAYERS):
    got = {}
    teacher = teacher or TeacherSpec()
    tap = Tap({f"hidden.{k}" for k in layers} | {"teacher"}, sink=lambda sid, t: got.__setitem__(sid, t),
              storage_dtype=tap_dtype, teacher=teacher, hidden_size=model.config.hidden_size)
    with hf_taps(model, tap, layers, teacher.kind), torch.inference_mode():
        tap.begin(batch)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        tap.end()
    report = tap.close()
    return got, out, report


def test_fp32_capture_is_bitwise_equal_to_output_hidden_states(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    got, out, report = _capture(target.model, torch.float32, ids, mask, batch)
    assert report.errors == 0 and report.samples_written == 3
    for row, sid in enumerate(batch.ids):
        n = batch.lengths[row]
        for k in LAYERS:
            ref = out.hidden_states[to_hf_hidden_states_index(k)][row, :n]
            assert got[sid][f"hidden.{k}"].shape == (n, 576)
            assert torch.equal(got[sid][f"hidden.{k}"], ref), f"layer {k} of {sid} differs"


def test_bf16_capture_equals_rounded_reference(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    got, out, _ = _capture(target.model, torch.bfloat16, ids, mask, batch)
    for row, sid in enumerate(batch.ids):
        n = batch.lengths[row]
        for k in LAYERS:
            ref = out.hidden_states[k + 1][row, :n].to(torch.bfloat16)
            assert got[sid][f"hidden.{k}"].dtype == torch.bfloat16
            assert torch.equal(got[sid][f"hidden.{k}"], ref)


def test_tap_does_not_change_logits(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    with torch.inference_mode():
        plain = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).logits
    before = [dict(layer._forward_hooks) for layer in target.model.model.layers]  # transformers keeps its own
    _, tapped, _ = _capture(target.model, torch.bfloat16, ids, mask, batch)
    assert torch.equal(plain, tapped.logits)
    # and our hooks are gone afterwards
    assert [dict(layer._forward_hooks) for layer in target.model.model.layers] == before


def test_padding_excluded_and_matches_unbatched_forward(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    got, _, _ = _capture(target.model, torch.float32, ids, mask, batch)
    assert [got[s]["hidden.14"].shape[0] for s in batch.ids] == batch.lengths
    assert len(set(batch.lengths)) == 3, "the test needs mixed lengths"
    for row, sid in enumerate(batch.ids):
        n = batch.lengths[row]
        alone, _, _ = _capture(target.model, torch.float32, ids[row:row + 1, :n], mask[row:row + 1, :n],
                               Batch(ids=[sid], rows=[0], starts=[0], lengths=[n]))
        for k in LAYERS:
            torch.testing.assert_close(got[sid][f"hidden.{k}"], alone[sid][f"hidden.{k}"], atol=2e-4, rtol=1e-4)


def test_topk_teacher_matches_logits(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    got, out, _ = _capture(target.model, torch.bfloat16, ids, mask, batch, teacher=TeacherSpec(kind="topk", k=8))
    row, sid = 1, batch.ids[1]
    n = batch.lengths[row]
    ref_vals, ref_ids = torch.log_softmax(out.logits[row, :n].float(), -1).topk(8, dim=-1)
    assert got[sid]["teacher.topk_ids"].dtype == torch.int32
    assert torch.equal(got[sid]["teacher.topk_ids"].long(), ref_ids)
    torch.testing.assert_close(got[sid]["teacher.topk_logprobs"].float(), ref_vals, atol=2e-2, rtol=1e-3)
    # argmax of the target is the first of the top-k
    assert torch.equal(got[sid]["teacher.topk_ids"][:, 0].long(), out.logits[row, :n].argmax(-1))


def test_hidden_teacher_is_final_norm_output(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS[:2])
    got, out, _ = _capture(target.model, torch.float32, ids, mask, batch, teacher=TeacherSpec(kind="hidden", k=0))
    n = batch.lengths[0]
    assert torch.equal(got["s0"]["teacher.hidden"], out.hidden_states[-1][0, :n])  # HF's last entry is post-norm


def test_failure_inside_tap_never_reaches_the_forward(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)
    broken = Batch(ids=batch.ids, rows=batch.rows, starts=batch.starts, lengths=[10_000] * 3)  # index out of range
    with torch.inference_mode():
        plain = target.model(input_ids=ids, attention_mask=mask).logits
    got, out, report = _capture(target.model, torch.float32, ids, mask, broken)
    assert torch.equal(out.logits, plain)
    assert got == {}
    assert report.errors >= 1 and report.dropped_samples == 3
    assert "IndexError" in report.first_error or "index" in report.first_error.lower()


def test_sink_failure_is_counted_not_raised(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS)

    def bad_sink(sample_id, tensors):
        raise OSError("disk full")

    tap = Tap({"hidden.1", "teacher"}, sink=bad_sink, storage_dtype=torch.float32, hidden_size=576)
    with hf_taps(target.model, tap, [1]), torch.inference_mode():
        tap.begin(batch)
        target.model(input_ids=ids, attention_mask=mask)
        tap.end()
    report = tap.close()
    assert report.errors == 1 and report.dropped_samples == 3 and "disk full" in report.first_error


def test_hooks_idle_outside_a_batch(target):
    got = {}
    tap = Tap({"hidden.1", "teacher"}, sink=lambda s, t: got.__setitem__(s, t), hidden_size=576)
    ids = target.tokenizer("Hello there", return_tensors="pt")["input_ids"]
    with hf_taps(target.model, tap, [1]), torch.inference_mode():
        target.model.generate(ids, max_new_tokens=3, do_sample=False)  # decode passes: no begin(), nothing kept
    report = tap.close()
    assert got == {} and report.errors == 0 and report.batches == 0


def test_missing_output_is_reported(target):
    ids, mask, batch = _padded(target.tokenizer, TEXTS[:1])
    tap = Tap({"hidden.1", "hidden.99", "teacher"}, sink=lambda s, t: None, hidden_size=576)
    with hf_taps(target.model, tap, [1]), torch.inference_mode():
        tap.begin(batch)
        target.model(input_ids=ids, attention_mask=mask)
        tap.end()
    report = tap.close()
    assert report.errors == 1 and "hidden.99" in report.first_error


@pytest.mark.gpu
def test_cuda_async_handoff_equals_reference(target):
    model = target.model.to("cuda")
    try:
        ids, mask, batch = _padded(target.tokenizer, TEXTS)
        got, out, report = _capture(model, torch.float32, ids.cuda(), mask.cuda(), batch)
        assert report.errors == 0
        for row, sid in enumerate(batch.ids):
            n = batch.lengths[row]
            assert torch.equal(got[sid]["hidden.14"], out.hidden_states[15][row, :n].cpu())
    finally:
        target.model.to("cpu")
