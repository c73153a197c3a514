"""fp8 stores on the CPU: per-token scaled e4m3 round-trips within fp8's step (zeros, huge and tiny rows included),
through the crash-safe writer and the reader, into the trainer's batches, with the sizes `hstap store info` reports."""

from __future__ import annotations

import json

import pytest
import torch

from hstap.cli import main
from hstap.config import rounding_step
from hstap.errors import HstapError
from hstap.store import (StoreWriter, bytes_per_token, conventional_specs, human_bytes, open_store, store_info,
                         verify_store)
from hstap.store.fp8 import FP8, FP8_MAX, dequantize, dequantize_aux, quantize
from tests.store.conftest import LAYERS, H, make_sample

HALF_STEP = rounding_step("fp8") / 2  # round to nearest: at most half of e4m3's relative spacing 2**-3
TINY = 2.0 ** -6 / FP8_MAX  # below this fraction of a row's largest value, e4m3 is subnormal (absolute steps)


def _rows() -> torch.Tensor:
    """Rows a residual stream has: ordinary, one 1000x outlier dimension, huge, tiny, all zero, one nonzero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    x[1, 5] = 1000.0  # a massive-activation dimension
    x[2] *= 1e30  # would overflow e4m3 (max 448) without its scale
    x[3] *= 1e-30  # would underflow to zero without its scale
    x[4] = 0.0
    x[5] = 0.0
    x[5, 7] = -3.0
    x[6] = torch.finfo(torch.bfloat16).max * torch.sign(x[6])  # bf16's largest: amax / 448 must not overflow
    return x


def test_quantize_round_trips_within_half_a_step_per_row():
    x = _rows()
    q, scale = quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (8,)
    assert torch.isfinite(q.float()).all(), "no row may saturate into NaN"
    back = dequantize(q, scale, torch.float32)
    assert scale[4] == 0 and torch.equal(back[4], torch.zeros(64)), "a zero row stays exactly zero"
    assert back[5, 7] == -3.0 and back[5].count_nonzero() == 1, "a row's largest value is exact (it maps to 448)"
    normal = x.abs() >= TINY * x.abs().amax(-1, keepdim=True)  # where e4m3's step is relative
    rel = ((back - x).abs() / x.abs().clamp_min(1e-38))[normal]
    slack = 1 + 1e-5  # the fp32 division by the scale and the multiplication back round too
    assert rel.max() <= HALF_STEP * slack, f"worst element off by {rel.max():.4f} of itself, fp8 allows {HALF_STEP}"
    below = (back - x).abs()[~normal]  # subnormal elements: off by at most half of the smallest step, absolutely
    bound = (2.0 ** -9 / 2 * scale[:, None]).expand_as(x)[~normal]
    assert (below <= bound * slack).all()
    row_rel = (back - x).double().norm(dim=-1) / x.double().norm(dim=-1).clamp_min(1e-300)  # fp32 squares overflow
    assert row_rel.max() <= HALF_STEP * slack  # what `hstap compare` measures, per token


def test_quantize_keeps_the_input_dtype_and_device_agnostic_math():
    x = _rows()[:2].to(torch.bfloat16)
    q, scale = quantize(x)
    q32, scale32 = quantize(x.float())
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(scale, scale32)
    assert dequantize(q, scale).dtype == torch.bfloat16


def _fp8_meta(meta):
    return meta.model_copy(update={"hidden_dtype": "fp8"})


def _fp8_sample(seed: int) -> dict[str, torch.Tensor]:
    sample = make_sample(seed)
    sample["teacher.topk_logprobs"] = sample["teacher.topk_logprobs"].half()  # as the tap stores them
    for k in LAYERS:
        x = sample.pop(f"hidden.{k}").float()
        x[0] = 0.0  # a zero token in every layer
        sample[f"hidden.{k}"], sample[f"hidden_scale.{k}"] = quantize(x)
    return sample


def test_store_round_trip_through_the_writer_and_reader(tmp_path, meta):
    samples = {f"s{i}": _fp8_sample(i) for i in range(12)}
    with StoreWriter(tmp_path, _fp8_meta(meta), shard_bytes=2048) as w:
        for sid, sample in samples.items():
            w.add(sid, sample)
    assert verify_store(tmp_path) == []
    store = open_store(tmp_path)
    assert len(store.manifest.shards) > 1, "small shards: several commits"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["meta"]["hidden_dtype"] == "fp8"
    assert manifest["tensors"]["hidden.14"] == {"dtype": "fp8", "shape": [H]}
    assert manifest["tensors"]["hidden_scale.14"] == {"dtype": "fp32", "shape": []}
    assert store.manifest.tensors == conventional_specs(store.manifest.meta), "capture's estimate = what is written"
    for i, (sid, want) in enumerate(samples.items()):
        raw = store.read(i, dequantize=False)
        got = store[i]
        for k in LAYERS:
            assert raw["hidden"][k].dtype == FP8
            assert torch.equal(raw["hidden"][k].view(torch.uint8), want[f"hidden.{k}"].view(torch.uint8))
            assert torch.equal(raw["hidden_scale"][k], want[f"hidden_scale.{k}"])
            assert got["hidden"][k].dtype == torch.bfloat16 and "hidden_scale" not in got
            assert torch.equal(got["hidden"][k], dequantize(want[f"hidden.{k}"], want[f"hidden_scale.{k}"]))
            assert torch.equal(got["hidden"][k][0], torch.zeros(H, dtype=torch.bfloat16))
    only = store.read(3, keys={"hidden.14"})
    assert set(only["hidden"]) == {14} and only["hidden"][14].dtype == torch.bfloat16, "scales come with the layer"


def test_writer_refuses_fp8_without_its_scales(tmp_path, meta):
    sample = _fp8_sample(0)
    del sample["hidden_scale.14"]
    with StoreWriter(tmp_path, _fp8_meta(meta)) as w:
        with pytest.raises(HstapError, match=r"sample 'a': fp8 tensor 'hidden.14' needs 'hidden_scale.14' \(fp32, "
                                             r"one per token\), got none"):
            w.add("a", sample)
    sample = _fp8_sample(0)
    sample["hidden.1"] = sample["hidden.1"].float()
    with StoreWriter(tmp_path / "b", _fp8_meta(meta)) as w:
        with pytest.raises(HstapError, match="tensor 'hidden.1' is fp32 .16., the store meta says fp8 .16."):
            w.add("a", sample)


def test_store_info_reports_bytes_per_token_and_projections(tmp_path, meta, capsys):
    with StoreWriter(tmp_path, _fp8_meta(meta)) as w:
        for i in range(10):
            w.add(f"s{i}", _fp8_sample(i))
    info = store_info(tmp_path, project=[1000])
    per_token = 3 * (H + 4) + 4 * 4 + 2 * 4 + 4 + 1  # 3 fp8 layers + scales, top-4 teacher, input_ids, loss_mask
    assert info["bytes_per_token_estimate"] == per_token == bytes_per_token(conventional_specs(_fp8_meta(meta)))
    assert info["teacher_bytes_per_token"] == 4 * 4 + 2 * 4
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("shard-*.safetensors"))
    assert info["bytes_per_token"] == pytest.approx(on_disk / info["tokens"])
    assert info["bytes_per_token"] > per_token, "the shard headers (sample ids) are measured too"
    assert info["projected"] == {1000: human_bytes(info["bytes_per_token"] * info["tokens"] / 10 * 1000)}
    assert main(["store", "info", str(tmp_path), "--project", "5000", "--project", "20000"]) == 0
    out = capsys.readouterr().out
    assert "5,000 samples" in out and "20,000 samples" in out and "measured over the shards" in out
    assert main(["store", "info", str(tmp_path), "--project", "0"]) == 2
    assert "store.project" in capsys.readouterr().err


def _batches(tmp_path, meta, device: str, monkeypatch) -> tuple:
    """load_batch over a synthetic fp8 store on `device`, recording what reached the dequantisation."""
    import hstap.train.data as data

    with StoreWriter(tmp_path, _fp8_meta(meta)) as w:
        for i in range(4):
            w.add(f"s{i}", _fp8_sample(i))
    seen = []

    def spy(aux, scales, *args):
        seen.append((aux.dtype, aux.device.type, scales.device.type))
        return dequantize_aux(aux, scales, *args)

    monkeypatch.setattr(data, "dequantize_aux", spy)
    batch = data.load_batch(data.StoreSource(open_store(tmp_path)), [2, 0, 3], LAYERS, torch.device(device))
    return batch, seen


def test_trainer_moves_fp8_and_dequantises_on_its_device(tmp_path, meta, monkeypatch):
    batch, seen = _batches(tmp_path, meta, "cpu", monkeypatch)
    assert seen == [(FP8, "cpu", "cpu")], "collated and copied as fp8 + scales, dequantised after the copy"
    store = open_store(tmp_path)
    for row, i in enumerate([2, 0, 3]):
        s = store[i]  # the reader's own dequantisation: the same numbers
        n = len(s["input_ids"])
        assert torch.equal(batch.aux[row, :n], torch.cat([s["hidden"][k] for k in LAYERS], dim=-1))
        assert not batch.aux[row, n:].any() and not batch.valid[row, n:].any()


@pytest.mark.gpu
def test_cuda_quantises_and_dequantises_like_the_cpu(tmp_path, meta, monkeypatch):
    x = _rows()
    q, scale = quantize(x)
    qc, scalec = quantize(x.cuda())
    assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(scalec.cpu(), scale)
    assert torch.equal(dequantize(qc, scalec).cpu(), dequantize(q, scale))
    cuda, seen = _batches(tmp_path / "a", meta, "cuda", monkeypatch)
    assert seen[-1] == (FP8, "cuda", "cuda") and cuda.aux.device.type == "cuda"
    cpu, _ = _batches(tmp_path / "b", meta, "cpu", monkeypatch)
    assert torch.equal(cuda.aux.cpu(), cpu.aux)
