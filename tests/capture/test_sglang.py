"""The SGLang adapter through SGLang's real `register_forward_hooks`, with the exact flags `hstap sglang-flags` prints.

The model is the real SmolLM2 behind SGLang's module names and each 0.5.23 decoder-layer contract (see
engine_model.py), served under the architecture whose SGLang layers have that contract: Llama (`stream`), Gemma-2
(`pairs`), Kimi-K2.5 (`stream_topk`, wrapped as `language_model`), and an architecture hstap does not know (`auto`).
Every stored sample must equal the transformers capture of the same conversation.
"""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch

from hstap.capture.engine_session import REQUESTS_NAME, close_sessions
from hstap.cli import main
from hstap.config import TeacherSpec
from hstap.store import open_store
from hstap.store.compare import compare_stores

pytest.importorskip("sglang.srt.model_executor.hook_manager")
from sglang.srt.model_executor.hook_manager import register_forward_hooks  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from tests.capture.conftest import LAYERS  # noqa: E402
from tests.capture.engine_model import (  # noqa: E402
    FB,
    ForwardMode,
    SgCausalLM,
    SgWrapped,
    decode_batch,
    extend_batch,
    forward_batch_fields,
)

pytestmark = pytest.mark.engine

# contract -> (architecture named in config.json, the engine_model contract its SGLang layers follow)
SERVED = {"stream": (None, "stream"), "pairs": ("Gemma2ForCausalLM", "pairs"),
          "stream_topk": ("KimiK25ForConditionalGeneration", "stream_topk"),
          "auto": ("NotYetInHstapsTableForCausalLM", "stream_topk")}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, str]:
    """`--model` per contract: SmolLM2's config.json under another architecture (config only, no weights)."""
    from hstap.models.target import resolve_model_dir

    base = json.loads((resolve_model_dir("smollm2")[0] / "config.json").read_text())
    out = {"stream": "smollm2"}
    for contract, (arch, _) in SERVED.items():
        if arch is None:
            continue
        d = tmp_path_factory.mktemp(contract)
        wrapped = {"architectures": [arch], "model_type": "kimi_k25", "text_config": base}
        (d / "config.json").write_text(json.dumps(wrapped if arch.startswith("Kimi") else
                                                  {**base, "architectures": [arch]}))
        out[contract] = str(d)
    return out


def _model(target, contract: str):
    layers = SERVED[contract][1]
    return SgWrapped(target.model, layers) if contract == "stream_topk" else SgCausalLM(target.model, layers)


def _server_args(capsys, out, dtype: str = "fp32", model: str = "smollm2") -> argparse.Namespace:
    """`hstap sglang-flags` output, parsed by SGLang's own CLI parser."""
    capsys.readouterr()
    assert main(["sglang-flags", "--model", model, "--layers", LAYERS, "--out", str(out), "--dtype", dtype]) == 0
    printed = capsys.readouterr().out
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "unused", *shlex.split(printed)])


def _tapped(target, contract, capsys, out, samples, served=None, dtype="fp32"):
    model = _model(target, contract)
    args = _server_args(capsys, out, dtype=dtype, model=(served or {}).get(contract, "smollm2"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / REQUESTS_NAME, "w") as f:  # what `hstap capture-remote` announces before sending
        for s in samples:
            f.write(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
    register_forward_hooks(model, args.forward_hooks)
    return model


def _finish(out) -> dict:
    reports = close_sessions()
    return reports[str(out.resolve())]


def _warmup_and_probe(model, tokenizer):
    warm = tokenizer("The capital city of France is", add_special_tokens=False)["input_ids"]
    model(extend_batch([("9f3c1d2e", warm, 0)]))  # SGLang's startup warmup: a random uuid rid
    model(extend_batch([("HEALTH_CHECK_ab12", [0], 0)]))  # /health_generate
    model(decode_batch([("9f3c1d2e", 11, len(warm))]))


def test_flags_parse_with_sglangs_parser_and_name_real_modules(target, capsys, tmp_path):
    args = _server_args(capsys, tmp_path / "cap", dtype="bf16")
    assert args.disable_radix_cache and args.cuda_graph_backend_prefill == "disabled"
    names = dict(SgCausalLM(target.model).named_modules())
    patterns = [p for spec in args.forward_hooks for p in spec["target_modules"]]
    assert all(p in names for p in patterns), [p for p in patterns if p not in names]
    assert {"model.layers.2.input_layernorm", "model.layers.15.input_layernorm", "model.norm"} <= set(patterns)
    assert main(["sglang-flags", "--model", "smollm2", "--layers", LAYERS, "--out", str(tmp_path / "cap"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == args.forward_hooks  # --json prints the same specs
    fields = forward_batch_fields()  # the real ForwardBatch, parsed from the installed SGLang's source
    assert {"forward_mode", "input_ids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "rids"} <= fields
    assert [m.name for m in ForwardMode][:4] == ["EXTEND", "DECODE", "MIXED", "IDLE"]


@pytest.mark.parametrize("contract", list(SERVED))
def test_packed_batches_equal_the_transformers_capture(target, tokenizer, capsys, tmp_path, convs, samples, served,
                                                       contract):
    out = tmp_path / "cap"
    model = _tapped(target, contract, capsys, out, samples, served)
    plain = _model(target, contract)
    hooked = {name for name, m in model.named_modules() if m._forward_hooks}
    if contract == "stream_topk":  # Kimi-K2.5: only the text model's modules, the vision tower's layers untouched
        assert hooked == {"language_model.model.layers.1", "language_model.model.layers.2.input_layernorm",
                          "language_model.model.layers.15.input_layernorm", "language_model.model.norm"}, hooked
    _warmup_and_probe(model, tokenizer)
    first = extend_batch([(f"r{i}", s.input_ids, 0) for i, s in enumerate(samples[:3])])
    logits = model(first)
    assert torch.equal(logits, plain(extend_batch([(f"r{i}", s.input_ids, 0) for i, s in enumerate(samples[:3])])))
    model(FB(ForwardMode.IDLE, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None, []))
    model(extend_batch([(f"r{i}", s.input_ids, 0) for i, s in enumerate(samples[3:], start=3)]))
    report = _finish(out)
    assert report["captured"] == 5 and report["errors"] == 0, report
    assert report["unmatched"] == 1  # the warmup request
    assert report["skipped"] == {"health_check": 1, "decode": 1, "idle": 1}
    cmp = compare_stores(out, convs[1], rtol=1e-5, min_cos=0.99999, any_model=True)  # wrapped: another config
    assert cmp.ok, cmp.verdict()
    store = open_store(out)
    assert store.ids() == [s.id for s in samples]
    assert store.manifest.meta.layer_ids == [1, 14, 29] and store.manifest.meta.teacher == TeacherSpec.parse("hidden")


def test_chunked_prefill_is_stitched_without_request_ids(target, capsys, tmp_path, convs, samples):
    out = tmp_path / "cap"
    model = _tapped(target, "stream", capsys, out, samples)
    long, other = samples[1].input_ids, samples[2].input_ids
    a, b = 20, 37
    model(extend_batch([("x", long[:a], 0)], rids=False))
    model(extend_batch([("y", other, 0), ("x", long[a:b], a)], rids=False))  # a chunk packed with a whole request
    model(extend_batch([("x", long[b:], b)], rids=False))
    report = _finish(out)
    assert report["captured"] == 2 and report["errors"] == 0 and report["open_partials"] == 0, report
    assert compare_stores(out, convs[1], rtol=1e-5, min_cos=0.99999).only_a == []
    cmp = compare_stores(convs[1], out, rtol=1e-5, min_cos=0.99999)
    assert cmp.common == 2 and not cmp.token_mismatch and all(s.max_rel < 1e-5 for s in cmp.tensors.values())


def test_fp8_capture_stitches_chunks_and_matches_within_fp8s_step(target, capsys, tmp_path, convs, samples):
    """`--dtype fp8` through SGLang's hooks: chunks of one request are quantised separately (per token, so the
    stitched sample equals a whole-request capture) and the hidden teacher stays bf16."""
    out = tmp_path / "cap"
    model = _tapped(target, "stream", capsys, out, samples, dtype="fp8")
    long = samples[1].input_ids
    model(extend_batch([("x", long[:20], 0), ("y", samples[2].input_ids, 0)], rids=False))
    model(extend_batch([("x", long[20:], 20), ("z", samples[0].input_ids, 0)], rids=False))
    report = _finish(out)
    assert report["captured"] == 3 and report["errors"] == 0, report
    tensors = open_store(out).manifest.tensors
    assert tensors["hidden.14"].dtype == "fp8" and tensors["hidden_scale.14"].dtype == "fp32"
    assert tensors["teacher.hidden"].dtype == "bf16"
    cmp = compare_stores(convs[1], out)  # the fp32 transformers capture: only fp8's rounding apart
    assert cmp.common == 3 and not cmp.token_mismatch and cmp.tensors["hidden.14"].rtol == 0.125
    assert all(s.max_rel <= s.rtol and s.min_cos >= s.cos_floor for s in cmp.tensors.values()), cmp.verdict()
    assert cmp.tensors["teacher.hidden"].max_rel < 8e-3, "bf16, not fp8"


def test_prefix_cache_hit_is_refused_not_stored(target, capsys, tmp_path, samples):
    out = tmp_path / "cap"
    model = _tapped(target, "stream", capsys, out, samples)
    ids = samples[0].input_ids
    model(extend_batch([("a", ids[:30], 0)]))  # someone else's request computed and cached this prefix
    model.kv["b"] = {k: v for k, v in model.kv["a"].items()}  # the radix cache hands it to request b
    model(extend_batch([("b", ids[30:], 30)]))
    capsys.readouterr()
    report = _finish(out)
    assert report.get("captured", 0) == 0 and report["refused_prefix_cached"] == 1, report
    assert len(open_store(out)) == 0
    err = capsys.readouterr().err  # the engine's log says it, in one line
    assert "hstap capture: 2 prefill requests seen, 0 captured" in err and "refused_prefix_cached 1" in err, err


def test_hook_failures_never_reach_the_engine(target, capsys, tmp_path, samples):
    out = tmp_path / "cap"
    model = _tapped(target, "stream", capsys, out, samples)
    good = [("r0", samples[0].input_ids, 0)]
    expected = SgCausalLM(target.model, "stream")(extend_batch(good))
    bad = extend_batch(good)
    bad.extend_seq_lens_cpu = ["garbage"]  # the hook's own code fails on it
    assert torch.equal(model(bad), expected)
    short = extend_batch(good)
    short.extend_seq_lens_cpu = [len(samples[0].input_ids) + 5]  # more rows than the forward has: refused on host
    model.kv.clear()
    assert torch.equal(model(short), expected)
    model.kv.clear()
    model(extend_batch(good))  # and the next forward is captured as usual
    report = _finish(out)
    assert report["errors"] >= 2 and report["captured"] == 1, report
    assert "TypeError" in report["first_error"]


def test_only_the_writer_rank_writes(target, capsys, tmp_path, samples):
    from sglang.srt.runtime_context import get_parallel

    out = tmp_path / "cap"
    with get_parallel().override(attn_tp_rank=1):  # a TP rank other than 0 gets a no-op hook
        model = _tapped(target, "stream", capsys, out, samples)
    model(extend_batch([("r0", samples[0].input_ids, 0)]))
    assert close_sessions() == {} and not (out / "manifest.json").exists()
    with get_parallel().override(attn_tp_rank=0, attn_dp_size=2, attn_dp_rank=1):  # DP attention: one store per group
        model = _tapped(target, "stream", capsys, out, samples)
    model(extend_batch([("r0", samples[0].input_ids, 0)]))
    _ = close_sessions()
    assert open_store(out / "dp1").ids() == [samples[0].id]
