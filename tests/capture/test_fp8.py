"""`hstap capture --dtype fp8` on the real SmolLM2: the tap quantises exactly, the store costs ≤ 3.1·H bytes per
token plus the teacher's, `hstap compare` accepts it against the bf16 capture of the same data (and still catches an
off-by-one layer), and the trainer reads it (dequantised after the copy to its device) and trains."""

from __future__ import annotations

import pytest
import torch

from hstap.capture.hf import hf_taps
from hstap.capture.layers import to_hf_hidden_states_index
from hstap.capture.tap import Batch, Tap
from hstap.cli import main
from hstap.config import TeacherSpec
from hstap.store import StoreWriter, open_store, store_info, verify_store
from hstap.store.compare import compare_stores
from hstap.store.fp8 import FP8, quantize
from hstap.train.config import TrainConfig
from hstap.train.data import StoreSource, load_batch
from hstap.train.run import load_metrics, run_train

LAYERS = [1, 14, 26]
CAPTURE = ["--limit", "4", "--max-tokens", "96", "--batch-tokens", "1024"]


@pytest.fixture(scope="module")
def stores(target, tmp_path_factory):
    """(fp8 store, bf16 store) of the same 4 ShareGPT conversations, through `hstap capture` itself (the session's
    SmolLM2 stands in for the reload)."""
    d = tmp_path_factory.mktemp("fp8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hstap.capture.run.load_target", lambda *a, **k: target)
        for dtype in ("fp8", "bf16"):
            assert main(["capture", *CAPTURE, "--dtype", dtype, "--out", str(d / dtype)]) == 0
    return d / "fp8", d / "bf16"


def test_tap_stores_the_quantised_forward_and_a_bf16_hidden_teacher(target):
    texts = ["The quick brown fox jumps over the lazy dog.", "Hi"]
    rows = [target.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = torch.full((2, len(rows[0])), target.tokenizer.pad_token_id)
    ids[0], ids[1, :len(rows[1])] = torch.tensor(rows[0]), torch.tensor(rows[1])
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    batch = Batch(ids=["a", "b"], rows=[0, 1], starts=[0, 0], lengths=[len(r) for r in rows])
    got = {}
    tap = Tap({f"hidden.{k}" for k in LAYERS} | {"teacher"}, sink=got.__setitem__, storage_dtype=FP8,
              teacher=TeacherSpec(kind="hidden", k=0), hidden_size=576)
    with hf_taps(target.model, tap, LAYERS, "hidden"), torch.inference_mode():
        tap.begin(batch)
        out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        tap.end()
    assert tap.close().errors == 0
    for row, sid in enumerate(batch.ids):
        n = batch.lengths[row]
        for k in LAYERS:
            q, scale = quantize(out.hidden_states[to_hf_hidden_states_index(k)][row, :n])
            assert torch.equal(got[sid][f"hidden.{k}"].view(torch.uint8), q.view(torch.uint8)), (sid, k)
            assert torch.equal(got[sid][f"hidden_scale.{k}"], scale), (sid, k)
        teacher = got[sid]["teacher.hidden"]
        assert teacher.dtype == torch.bfloat16, "the training target is not quantised"
        assert torch.equal(teacher, out.hidden_states[-1][row, :n].to(torch.bfloat16))


def test_fp8_store_costs_at_most_3_1_h_bytes_per_token_plus_the_teacher(stores):
    fp8, bf16 = stores
    assert verify_store(fp8) == []
    info, ref = store_info(fp8), store_info(bf16)
    h = info["hidden_size"]
    assert info["hidden_dtype"] == "fp8" and info["tokens"] == ref["tokens"] > 300
    assert info["bytes_per_token"] - info["teacher_bytes_per_token"] <= 3.1 * h, info  # measured: ~3.03·H
    assert ref["bytes_per_token"] - ref["teacher_bytes_per_token"] > 6 * h  # the bf16 store of the same data
    assert info["bytes_per_token_estimate"] == 3 * (h + 4) + 192 + 5  # the figure capture printed up front


def test_compare_accepts_fp8_against_bf16_and_still_catches_an_off_by_one_layer(stores, target, tmp_path):
    fp8, bf16 = stores
    c = compare_stores(fp8, bf16)
    assert c.ok, c.verdict()
    for k in LAYERS:
        s = c.tensors[f"hidden.{k}"]
        assert s.rtol == 0.125 and s.cos_floor == pytest.approx(1 - 0.125 ** 2 / 2)
        assert 0 < s.max_rel < 0.05 and s.min_cos > 0.999, (k, s)  # measured ~0.004-0.023, cosine > 0.9994
    # The same samples stored one layer off (hidden_states[k + 2] as layer k: the classic convention mix-up), in
    # fp8: the per-token cosine (0.83-0.93 between neighbouring layers of SmolLM2) fails every layer.
    samples = list(open_store(bf16))
    lengths = [len(s["input_ids"]) for s in samples]
    ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :lengths[row]] = s["input_ids"]
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()  # right padding
    with torch.inference_mode():
        states = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    shifted = tmp_path / "shifted"
    with StoreWriter(shifted, open_store(bf16).manifest.meta.model_copy(update={"hidden_dtype": "fp8"})) as w:
        for row, s in enumerate(samples):
            tensors = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                       **{f"teacher.{n}": t for n, t in s["teacher"].items()}}
            for k in LAYERS:
                tensors[f"hidden.{k}"], tensors[f"hidden_scale.{k}"] = quantize(states[k + 2][row, :lengths[row]])
            w.add(s["id"], tensors)
    c = compare_stores(shifted, bf16)
    assert not c.ok and all(c.tensors[f"hidden.{k}"].min_cos < 0.95 for k in LAYERS), c.verdict()


def test_trainer_dequantises_on_its_device_and_trains_like_bf16(stores, target, tmp_path, monkeypatch):
    fp8, bf16 = stores
    head = target.model.get_output_embeddings()
    a = load_batch(StoreSource(open_store(fp8), head), [0, 1], LAYERS, torch.device("cpu"))
    b = load_batch(StoreSource(open_store(bf16), head), [0, 1], LAYERS, torch.device("cpu"))
    assert a.aux.dtype == b.aux.dtype == torch.bfloat16 and a.aux.shape == b.aux.shape
    assert torch.equal(a.valid, b.valid) and torch.equal(a.topk_ids, b.topk_ids)
    assert torch.equal(a.aux[~a.valid], torch.zeros_like(a.aux[~a.valid])), "padding stays zero"
    rel = (a.aux.double() - b.aux.double()).norm(dim=-1)[a.valid] / b.aux.double().norm(dim=-1)[a.valid]
    assert rel.max() < 0.0625, rel.max()  # per token, all three layers: within half of fp8's step

    monkeypatch.setattr("hstap.models.load_target", lambda *a, **k: target)  # the session's SmolLM2, not a reload
    fast = dict(max_steps=2, batch_tokens=192, draft_vocab=1024, ttt_steps=2, heldout=0, seed=0, calib_prompts=0)
    losses = {}
    for name, store in (("fp8", fp8), ("bf16", bf16)):
        run_train(TrainConfig(store=store, out=tmp_path / name, **fast), progress=False)
        losses[name] = [r["loss"] for r in load_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses["fp8"]) == 2 and losses["fp8"] != losses["bf16"], "the fp8 run read fp8"
    # measured 1e-4 apart: fp8's rounding noise on the features barely moves the loss (a dropped scale would)
    torch.testing.assert_close(torch.tensor(losses["fp8"]), torch.tensor(losses["bf16"]), rtol=1e-3, atol=0)


@pytest.mark.gpu
def test_cuda_tap_copies_fp8_and_scales_through_pinned_memory():
    """The CUDA hand-off (side stream, pinned host buffers, an event) carries fp8 bytes and fp32 scales."""
    x = torch.randn(2, 7, 576, device="cuda") * torch.logspace(-3, 3, 7, device="cuda")[None, :, None]  # (B, S, H)
    x[1, 6] = 0  # padding of row 1: never copied
    batch = Batch(ids=["a", "b"], rows=[0, 1], starts=[0, 0], lengths=[7, 5])
    got = {}
    tap = Tap({"hidden.1"}, sink=got.__setitem__, storage_dtype=FP8, hidden_size=576)
    tap.begin(batch)
    tap.record("hidden.1", x)
    tap.end()
    assert tap.close().errors == 0
    for row, sid in enumerate(batch.ids):
        q, scale = quantize(x[row, :batch.lengths[row]].cpu())
        assert got[sid]["hidden.1"].dtype == FP8 and got[sid]["hidden.1"].device.type == "cpu"
        assert torch.equal(got[sid]["hidden.1"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got[sid]["hidden_scale.1"], scale)
