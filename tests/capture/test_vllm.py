"""The vLLM worker extension: `install_taps` / `remove_taps` on a model with vLLM's layer contract (real SmolLM2
weights), fed the forward-context facts vLLM's attention metadata carries. vLLM itself needs a CUDA build to
import; the last test runs the real engine where it is importable (see docs/engines.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import hstap.capture.vllm as hv
from hstap.capture.arch import VLLM
from hstap.capture.engine_session import REQUESTS_NAME, EngineCaptureConfig
from hstap.errors import HstapError
from hstap.store import open_store
from hstap.store.compare import compare_stores
from tests.capture.conftest import LAYERS
from tests.capture.engine_model import VLLM_INFO, VllmCausalLM, VllmWrapped, skeleton, vllm_step
from tests.capture.test_arch import KIMI_K25, SEED_LAYERS


class FakeWorker(hv.HstapWorkerExtension):
    """What `--worker-extension-cls` mixes the extension into: a worker with `model_runner.model`."""

    def __init__(self, model):
        self.model_runner = type("Runner", (), {"model": model})()


@pytest.fixture
def worker(target, tmp_path, samples, monkeypatch):
    monkeypatch.setattr(hv, "forward_info", lambda: VLLM_INFO[0])
    out = tmp_path / "cap"
    out.mkdir()
    (out / REQUESTS_NAME).write_text("".join(json.dumps({"id": s.id, "input_ids": s.input_ids,
                                                         "loss_mask": s.loss_mask}) + "\n" for s in samples))
    cfg = EngineCaptureConfig.for_checkpoint("smollm2", LAYERS, out, "vllm", dtype="fp32")
    w = FakeWorker(VllmCausalLM(target.model))
    assert "writing to" in w.install_taps(cfg.model_dump_json())  # what collective_rpc passes: a JSON string
    return w, out, cfg.model_dump_json()


def test_mixed_batches_equal_the_transformers_capture(worker, target, convs, samples):
    w, out, _ = worker
    model = w.model_runner.model
    plain = VllmCausalLM(target.model)
    s0, s1, s2, s3, s4 = (s.input_ids for s in samples)
    first = [("a", s0, 0), ("b", s1[:25], 0)]  # a whole request and a first chunk
    assert torch.equal(vllm_step(model, first), vllm_step(plain, first))  # the taps change nothing
    vllm_step(model, [("a", [7], len(s0)), ("b", s1[25:], 25), ("c", s2, 0)])  # a decode row, the last chunk, one more
    vllm_step(model, [("a", [8], len(s0) + 1), ("c", [9], len(s2))])  # pure decode: skipped
    vllm_step(model, [("d", s3, 0), ("e", s4, 0)])
    report = json.loads(w.remove_taps())[str(out.resolve())]
    assert report["captured"] == 5 and report["errors"] == 0, report
    assert report["skipped"] == {"decode": 1}  # the decode row of the mixed batch was never copied
    cmp = compare_stores(out, convs[1], rtol=1e-5, min_cos=0.99999)
    assert cmp.ok, cmp.verdict()
    assert not any(layer._forward_hooks for layer in model.model.layers)  # remove_taps took them off


def test_fp8_capture_through_the_extension(target, tmp_path, convs, samples, monkeypatch):
    """`--dtype fp8` via `install_taps`: a chunked request and a decode row in one step; fp8 within its step of
    the fp32 transformers capture, scales stored, the hidden teacher bf16."""
    monkeypatch.setattr(hv, "forward_info", lambda: VLLM_INFO[0])
    out = tmp_path / "cap"
    out.mkdir()
    (out / REQUESTS_NAME).write_text("".join(json.dumps({"id": s.id, "input_ids": s.input_ids,
                                                         "loss_mask": s.loss_mask}) + "\n" for s in samples))
    w = FakeWorker(VllmCausalLM(target.model))
    w.install_taps(EngineCaptureConfig.for_checkpoint("smollm2", LAYERS, out, "vllm", dtype="fp8").model_dump_json())
    model = w.model_runner.model
    s0, s1 = samples[0].input_ids, samples[1].input_ids
    vllm_step(model, [("a", s0, 0), ("b", s1[:25], 0)])
    vllm_step(model, [("a", [7], len(s0)), ("b", s1[25:], 25)])
    report = json.loads(w.remove_taps())[str(out.resolve())]
    assert report["captured"] == 2 and report["errors"] == 0, report
    tensors = open_store(out).manifest.tensors
    assert tensors["hidden.29"].dtype == "fp8" and tensors["hidden_scale.29"].dtype == "fp32"
    assert tensors["teacher.hidden"].dtype == "bf16"
    cmp = compare_stores(convs[1], out)
    assert cmp.common == 2 and not cmp.token_mismatch, cmp.verdict()
    assert all(s.max_rel <= s.rtol and s.min_cos >= s.cos_floor for s in cmp.tensors.values()), cmp.verdict()


def test_prefix_cache_hit_is_refused(worker, samples):
    w, out, config = worker
    model = w.model_runner.model
    ids = samples[0].input_ids
    w.hstap_remove_all()
    vllm_step(model, [("a", ids[:30], 0)])  # computed while no tap was on: these rows exist nowhere in the capture
    assert "writing to" in w.install_taps(config)
    model.kv["b"] = dict(model.kv["a"])  # vLLM's prefix cache gives request b those 30 tokens
    vllm_step(model, [("b", ids[30:], 30)])
    report = json.loads(w.remove_taps())[str(out.resolve())]
    assert report["refused_prefix_cached"] == 1 and report.get("captured", 0) == 0, report
    assert len(open_store(out)) == 0


def test_kimi_k25_wrapper_fed_inputs_embeds_equals_the_transformers_capture(target, tmp_path, convs, samples,
                                                                            monkeypatch):
    """SmolLM2 inside a Kimi-K2.5-shaped wrapper, run the way vLLM runs a multimodal model (input_ids=None): the
    taps sit on language_model.model.* and take the token ids from the embedding's pre-hook."""
    from hstap.models.target import resolve_model_dir

    monkeypatch.setattr(hv, "forward_info", lambda: VLLM_INFO[0])
    served = tmp_path / "kimi-shaped"
    served.mkdir()
    base = json.loads((resolve_model_dir("smollm2")[0] / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**KIMI_K25, "text_config": base}))
    out = tmp_path / "cap"
    out.mkdir()
    (out / REQUESTS_NAME).write_text("".join(json.dumps({"id": s.id, "input_ids": s.input_ids,
                                                         "loss_mask": s.loss_mask}) + "\n" for s in samples))
    cfg = EngineCaptureConfig.for_checkpoint(str(served), LAYERS, out, "vllm", dtype="fp32")
    w = FakeWorker(VllmWrapped(target.model))
    assert "taps on language_model.model.layers [1, 14, 29]" in w.install_taps(cfg.model_dump_json())
    model = w.model_runner.model
    s0, s1, s2, s3, s4 = (s.input_ids for s in samples)
    vllm_step(model, [("a", s0, 0), ("b", s1, 0)], embeds=True)
    vllm_step(model, [("a", [7], len(s0)), ("c", s2, 0), ("d", s3, 0), ("e", s4, 0)], embeds=True)
    report = json.loads(w.remove_taps())[str(out.resolve())]
    assert report["captured"] == 5 and report["errors"] == 0 and "no_input_ids" not in report["skipped"], report
    cmp = compare_stores(out, convs[1], rtol=1e-5, min_cos=0.99999, any_model=True)  # wrapped: another config
    assert cmp.ok, cmp.verdict()


def test_the_extension_resolves_kimis_seed_layers_or_fails_in_one_line(tmp_path):
    out = tmp_path / "cap"
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(KIMI_K25))
    cfg = EngineCaptureConfig.for_checkpoint(str(tmp_path / "kimi"), SEED_LAYERS, out, "vllm")
    model = skeleton(VLLM["KimiK25ForConditionalGeneration"], 61)
    w = FakeWorker(model)
    w.install_taps(cfg.model_dump_json())
    hooked = {n for n, m in model.named_modules() if m._forward_hooks}
    pre = {n for n, m in model.named_modules() if m._forward_pre_hooks}
    text = "language_model.model"
    assert hooked == {f"{text}.layers.3", f"{text}.layers.31", f"{text}.layers.59", f"{text}.norm"}, hooked
    assert pre == {"", f"{text}.embed_tokens"}
    w.remove_taps()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # an unknown architecture: the served module tree decides
    generic = cfg.model_copy(update={"layout": cfg.layout.__class__(architecture="X", text=("model",), known=False)})
    assert f"taps on {text}.layers" in w.install_taps(generic.model_dump_json())
    w.remove_taps()
    # a known architecture whose row names a module that is not there: one line, and no store opened
    wrong = cfg.model_copy(update={"layout": replace(VLLM["LlamaForCausalLM"], architecture="LlamaForCausalLM"),
                                   "out": tmp_path / "cap2"})
    with pytest.raises(HstapError, match=r"\(LlamaForCausalLM\): no decoder-layer list at model\.layers; "
                                         r"ModuleLists of 61 named 'layers': \['language_model\.model\.layers'\]") as e:
        w.install_taps(wrong.model_dump_json())
    assert "\n" not in str(e.value) and not (tmp_path / "cap2").exists()


@pytest.mark.engine
@pytest.mark.gpu
def test_real_vllm_engine_equals_transformers(tmp_path, convs, samples):
    """On a GPU machine with vLLM installed (docs/engines.md): the real engine through collective_rpc."""
    vllm = pytest.importorskip("vllm")
    from hstap.models.target import resolve_model_dir

    out = tmp_path / "cap"
    out.mkdir()
    (out / REQUESTS_NAME).write_text("".join(json.dumps({"id": s.id, "input_ids": s.input_ids,
                                                         "loss_mask": s.loss_mask}) + "\n" for s in samples))
    cfg = EngineCaptureConfig.for_checkpoint("smollm2", LAYERS, out, "vllm", dtype="fp32")
    llm = vllm.LLM(model=str(resolve_model_dir("smollm2")[0]), enforce_eager=True, enable_prefix_caching=False,
                   worker_extension_cls=hv.EXTENSION, dtype="float32", gpu_memory_utilization=0.3)
    llm.collective_rpc("install_taps", args=(cfg.model_dump_json(),))
    llm.generate([{"prompt_token_ids": s.input_ids} for s in samples], vllm.SamplingParams(max_tokens=1))
    llm.collective_rpc("remove_taps")
    cmp = compare_stores(out, convs[1], rtol=2e-3, min_cos=0.9999)
    assert cmp.ok, cmp.verdict()


def test_vllm_flags_prints_the_launch_flags_and_the_rpc_body(tmp_path, capsys):
    from hstap.capture.engine_session import EngineCaptureConfig
    from hstap.cli import main

    assert main(["vllm-flags", "--model", "smollm2", "--out", str(tmp_path / "cap"), "--rpc"]) == 0
    body = json.loads(capsys.readouterr().out)
    cfg = EngineCaptureConfig.model_validate_json(body["args"][0])  # what install_taps receives
    assert body["method"] == "install_taps" and cfg.layers == [1, 14, 26] and cfg.engine == "vllm"
    assert main(["vllm-flags", "--model", "smollm2", "--out", str(tmp_path / "cap")]) == 0
    out = capsys.readouterr().out
    assert "--enforce-eager --no-enable-prefix-caching --worker-extension-cls " + hv.EXTENSION in out
