"""Export to SGLang / vLLM: every name, shape, dtype and value read back, and the layer ids each engine derives.

The engine expectations below restate what the loaders do, read in SGLang 0.5.23 and vLLM 0.33.0 (docs/export.md
names the files): neither engine's model code imports on a CPU, so the tests apply the loaders' documented name
rules and id conventions to the files hstap writes, and load those files with safetensors and transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig

from hstap.cli import main
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, draft_to_target_ids
from hstap.errors import HstapError
from hstap.export.formats import FORMATS, expected_shapes, export_vllm, sglang_layer_ids, vllm_layer_ids
from hstap.export.write import export_drafter

SMOLLM2_IDS = [1, 14, 26]  # canonical EAGLE-3 default for 30 layers: [1, L//2 - 1, L - 4]
DRAFT_VOCAB = 2048

# Parameter names each engine's draft model owns (weights it does not find are silently dropped by SGLang).
SGLANG_PARAMS = {
    "model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
}
VLLM_PARAMS = SGLANG_PARAMS | {"draft_id_to_target_id"}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}


def sglang_param_names(names) -> set[str]:
    """SGLang LlamaForCausalLMEagle3.load_weights: midlayer→layers.0, d2t/t2d aside, stacked, 'model.' prefix."""
    out = set()
    for name in names:
        name = name.replace("midlayer", "layers.0")
        if name in ("d2t", "t2d"):
            continue
        for shard, fused in STACKED.items():
            name = name.replace(shard, fused)
        out.add(name if name == "lm_head.weight" else f"model.{name}")
    return out


def vllm_param_names(names) -> set[str]:
    """vLLM Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t→draft_id_to_target_id, 'model.' prefix unless
    lm_head; then LlamaModel's mapper renames midlayer.→layers.0. and stacks q/k/v and gate/up."""
    out = set()
    for name in names:
        if name == "t2d":
            continue
        if name == "d2t":
            out.add("draft_id_to_target_id")
            continue
        name = name.replace("midlayer.", "layers.0.")
        for shard, fused in STACKED.items():
            name = name.replace(shard, fused)
        out.add(name if name.startswith("lm_head") else f"model.{name}")
    return out


def sglang_captured(config: dict) -> list[int]:
    """Canonical ids SGLang captures: set_eagle3_layers_to_capture adds 1 to eagle_config's ids, and layer i's
    capture is the residual entering layer i, i.e. the stream after layer i-1."""
    layers_to_capture = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return [i - 1 for i in layers_to_capture]


def vllm_captured(config: dict) -> list[int]:
    """Canonical ids vLLM captures: the top-level ids win in both runners; id j is added after layer j-1."""
    return [j - 1 for j in sorted(set(config["eagle_aux_hidden_state_layer_ids"]))]


def token_counts() -> torch.Tensor:
    """Stand-in token frequencies over SmolLM2's vocabulary (the draft vocabulary is their top DRAFT_VOCAB)."""
    return torch.randint(0, 1000, (49152,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def run_dir(target, tmp_path_factory):
    """A real drafter run directory for SmolLM2, written by the drafter's own save_pretrained (no training)."""
    gen = torch.Generator().manual_seed(1)
    d2t, t2d = build_draft_vocab(token_counts(), DRAFT_VOCAB)
    cfg = DrafterConfig.from_target(target.model.config, SMOLLM2_IDS, DRAFT_VOCAB, target.model_id,
                                    target.fingerprint)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target.model, d2t, t2d)
    with torch.no_grad():  # norms start at ones: make every tensor distinct so a mix-up shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.rand(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("export") / "run"
    drafter.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def source(run_dir):
    return DrafterConfig.load(run_dir / "config.json"), load_file(str(run_dir / "model.safetensors"))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_export_reads_back_name_shape_dtype_value(fmt, run_dir, source, tmp_path):
    cfg, state = source
    out = export_drafter(run_dir, fmt, tmp_path / fmt)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hstap.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    shapes = expected_shapes(cfg)
    assert set(tensors) == set(shapes)  # no embedding: both engines share the target's
    h, n = 576, len(SMOLLM2_IDS)
    assert shapes["fc.weight"] == (h, n * h) and shapes["lm_head.weight"] == (DRAFT_VOCAB, h)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (9 * 64, 2 * h)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (3 * 64, 2 * h)
    for name, tensor in tensors.items():
        assert tuple(tensor.shape) == shapes[name], name
        if name == "d2t":
            assert tensor.dtype == torch.int64 and torch.equal(tensor, state["d2t"])
        elif name == "t2d":
            assert tensor.dtype == torch.bool and torch.equal(tensor, state["t2d"])
        else:
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sglang_param_names(tensors) == SGLANG_PARAMS  # every tensor lands on a parameter, none is left out
    assert vllm_param_names(tensors) == VLLM_PARAMS


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_config_is_the_llama_eagle3_config_both_loaders_read(fmt, run_dir, source, tmp_path):
    cfg, _ = source
    out = export_drafter(run_dir, fmt, tmp_path / fmt)
    raw = json.loads((out / "config.json").read_text())
    hf = AutoConfig.from_pretrained(out)
    assert isinstance(hf, LlamaConfig)
    assert hf.architectures == ["LlamaForCausalLMEagle3"] and hf.model_type == "llama"
    assert hf.num_hidden_layers == 1 and hf.hidden_act == "silu" and hf.tie_word_embeddings is False
    assert (hf.hidden_size, hf.intermediate_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == \
        (576, 1536, 9, 3, 64)
    assert hf.vocab_size == 49152 and hf.draft_vocab_size == DRAFT_VOCAB and hf.target_hidden_size == 576
    assert hf.num_aux_hidden_states == 3 and hf.rms_norm_eps == cfg.rms_norm_eps
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert raw["rope_theta"] == cfg.rope_theta and hf.max_position_embeddings == cfg.max_position_embeddings
    assert hf.dtype == torch.bfloat16 and raw["dtype"] == "bfloat16"
    assert hf.attention_bias is False and hf.mlp_bias is False
    assert hf.eagle_config == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": SMOLLM2_IDS}
    assert hf.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    provenance = json.loads((out / "hstap.json").read_text())
    assert provenance["aux_layer_ids"] == SMOLLM2_IDS and provenance["format"] == fmt
    assert provenance["target_model_id"] == cfg.target_model_id
    assert provenance["target_fingerprint"] == cfg.target_fingerprint
    assert provenance["engine_layer_ids"] == {"sglang": SMOLLM2_IDS, "vllm": [2, 15, 27]}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_engine_captures_the_canonical_layers(fmt, run_dir, tmp_path):
    config = json.loads((export_drafter(run_dir, fmt, tmp_path / fmt) / "config.json").read_text())
    # whichever engine serves either export, it reads the layers the drafter was trained on
    assert sglang_captured(config) == SMOLLM2_IDS
    assert vllm_captured(config) == SMOLLM2_IDS
    # and they are the engines' own EAGLE-3 defaults for a 30-layer target (SGLang [2, L//2, L-3] in its
    # layers_to_capture convention, vLLM (2, L//2, L-3))
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == [2, 15, 27]
    assert tuple(config["eagle_aux_hidden_state_layer_ids"]) == (2, 30 // 2, 30 - 3)


def test_d2t_is_an_offset_in_both_engines(run_dir, tmp_path):
    tensors = load_file(str(export_drafter(run_dir, "sglang", tmp_path / "x") / "model.safetensors"))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    top = torch.sort(torch.sort(-token_counts(), stable=True).indices[:DRAFT_VOCAB]).values  # most frequent
    sglang_hot_token_id = d2t + torch.arange(d2t.shape[0])  # llama_eagle3.py: loaded_weight + arange
    vllm_targets = torch.arange(DRAFT_VOCAB) + d2t  # compute_logits: base + draft_id_to_target_id
    assert torch.equal(sglang_hot_token_id, top) and torch.equal(vllm_targets, top)
    assert torch.equal(draft_to_target_ids(d2t), top)
    assert t2d.sum() == DRAFT_VOCAB and t2d[top].all()


def test_layer_id_conversion_for_a_61_layer_target():
    canonical = [1, 29, 57]  # [1, L//2 - 1, L - 4] for DeepSeek/Kimi-shaped targets
    assert sglang_layer_ids(canonical, 61) == [1, 29, 57]
    assert vllm_layer_ids(canonical, 61) == [2, 30, 58]
    assert tuple(vllm_layer_ids(canonical, 61)) == (2, 61 // 2, 61 - 3)  # vLLM's default in its convention
    assert [i + 1 for i in sglang_layer_ids(canonical, 61)] == [2, 61 // 2, 61 - 3]  # SGLang's layers_to_capture
    # the last layer: vLLM reads it (id L, before the final norm); SGLang captures at a next layer's entry only
    assert vllm_layer_ids([1, 29, 60], 61) == [2, 30, 61]
    with pytest.raises(HstapError, match=r"SGLang .*0\.\.59"):
        sglang_layer_ids([1, 29, 60], 61)
    for bad, match in (([29, 1, 57], "strictly increasing"), ([1, 1, 57], "strictly increasing"),
                       ([-1, 29, 57], "out of range"), ([], "empty")):
        for convert in (sglang_layer_ids, vllm_layer_ids):
            with pytest.raises(HstapError, match=match):
                convert(bad, 61)


def _tiny(draft_vocab: int) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    cfg = DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=4, vocab_size=10, draft_vocab_size=draft_vocab, aux_layer_ids=[0, 2, 3],
                        target_model_id="tiny", target_fingerprint="f", target_num_layers=5, target_hidden_size=8)
    state = {name: torch.randn(shape) for name, shape in expected_shapes(cfg).items()}
    state["d2t"], state["t2d"] = build_draft_vocab(torch.arange(10), draft_vocab)
    return cfg, state


def test_full_draft_vocabulary_drops_the_identity_maps():
    # vLLM 0.33.0 has no draft_id_to_target_id parameter when draft and target vocabularies match: a d2t would
    # be rejected as an unknown weight; SGLang then uses the head as is
    config, tensors = export_vllm(*_tiny(10))
    assert "d2t" not in tensors and "t2d" not in tensors and config["draft_vocab_size"] == config["vocab_size"]
    assert vllm_param_names(tensors) == SGLANG_PARAMS
    _, tensors = export_vllm(*_tiny(6))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_dtype_and_embedding_options(run_dir, source, target, tmp_path):
    _, state = source
    out = export_drafter(run_dir, "vllm", tmp_path / "f32", dtype="fp32", include_embedding=True)
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["fc.weight"], state["fc.weight"]) and tensors["fc.weight"].dtype == torch.float32
    assert torch.equal(tensors["embed_tokens.weight"], target.model.get_input_embeddings().weight.detach())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(HstapError, match="unknown export dtype 'int8'"):
        export_drafter(run_dir, "vllm", tmp_path / "int8", dtype="int8")


def test_cli_smoke(run_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["export", "--drafter", str(run_dir), "--format", "vllm", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "canonical [1, 14, 26] = SGLang [1, 14, 26] = vLLM [2, 15, 27]" in printed and "vllm serve" in printed
    assert (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it, from ExportConfig's Literal choices
        main(["export", "--drafter", str(run_dir), "--format", "tensorrt", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "invalid choice: 'tensorrt' (choose from 'sglang', 'vllm')" in err
    with pytest.raises(HstapError, match="unknown export format 'tensorrt': expected one of sglang, vllm"):
        export_drafter(run_dir, "tensorrt", tmp_path / "t")  # the Python API says the same in one line


def test_bad_inputs_are_one_line_errors(run_dir, tmp_path):
    with pytest.raises(HstapError, match="no such drafter directory"):
        export_drafter(tmp_path / "nope", "sglang", tmp_path / "o1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HstapError, match="no drafter config"):
        export_drafter(tmp_path / "empty", "sglang", tmp_path / "o2")
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text((run_dir / "config.json").read_text())
    with pytest.raises(HstapError, match="model.safetensors: missing"):
        export_drafter(half, "sglang", tmp_path / "o3")
    (half / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HstapError, match="not readable as safetensors"):
        export_drafter(half, "sglang", tmp_path / "o4")
    with pytest.raises(HstapError, match="is the drafter directory itself"):
        export_drafter(run_dir, "sglang", run_dir, force=True)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_inconsistent_weights_are_refused(run_dir, source, tmp_path):
    from safetensors.torch import save_file

    cfg, state = source
    for name, bad, match in (("lm_head.weight", torch.zeros(3, 576), "lm_head.weight has shape"),
                             ("d2t", torch.zeros(DRAFT_VOCAB, dtype=torch.int64), "d2t/t2d"),
                             ("midlayer.extra", torch.zeros(1), "unexpected \\['midlayer.extra'\\]")):
        broken = tmp_path / name
        broken.mkdir()
        cfg.save(broken / "config.json")
        save_file({**state, name: bad}, str(broken / "model.safetensors"))
        with pytest.raises(HstapError, match=match):
            export_drafter(broken, "vllm", tmp_path / f"out-{name}")


def test_existing_output_needs_force_and_is_replaced_whole(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(HstapError, match="not empty: choose another directory or pass --force"):
        export_drafter(run_dir, "sglang", out)
    import hstap.export.write as export_mod

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", fail)
    with pytest.raises(HstapError, match="disk full while writing the export; nothing was written"):
        export_drafter(run_dir, "sglang", out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "keep.txt").read_text() == "old"
    monkeypatch.undo()
    export_drafter(run_dir, "sglang", out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hstap.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---- train/serve parity: an export re-loaded as the engines read it and checked against its drafter ------------

def _broken(export, tmp_path, name, config=None, tensors=None, provenance=None):
    """A copy of `export` with one thing changed: config.json keys, tensors, or hstap.json keys."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / name
    shutil.copytree(export, bad)
    if config:
        cfg = json.loads((bad / "config.json").read_text())
        config(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(str(bad / "model.safetensors"))
        tensors(state)
        save_file(state, str(bad / "model.safetensors"))
    if provenance:
        prov = json.loads((bad / "hstap.json").read_text())
        prov.update(provenance)
        (bad / "hstap.json").write_text(json.dumps(prov))
    return bad


BROKEN = [  # (name, change, what the one line names)
    ("vllm-ids-not-shifted", dict(config=lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 14, 26])),
     "vllm would feed the drafter target layers [0, 13, 25] (canonical), it was trained on [1, 14, 26]"),
    ("sglang-ids-shifted", dict(config=lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids",
                                                                               [2, 15, 27])),
     "sglang would feed the drafter target layers [2, 15, 27]"),
    ("hidden-norm-ones", dict(tensors=lambda t: t.__setitem__("midlayer.hidden_norm.weight",
                                                              torch.ones_like(t["midlayer.hidden_norm.weight"]))),
     "midlayer.hidden_norm.weight differs from the drafter's (max |Δ|"),
    ("final-norm-missing", dict(tensors=lambda t: t.pop("norm.weight")),
     "norm.weight missing (the engine would leave it at its initial value)"),
    ("d2t-off-by-one", dict(tensors=lambda t: t.__setitem__("d2t", t["d2t"] + 1)), "d2t differs from the drafter's"),
    ("eps", dict(config=lambda c: c.__setitem__("rms_norm_eps", 1e-6)), "config.json: rms_norm_eps=1e-06"),
    ("another-model", dict(provenance={"target_fingerprint": "0000"}), "hstap.json: target_fingerprint='0000'"),
]


@pytest.fixture(scope="module")
def good_export(run_dir, tmp_path_factory):
    return export_drafter(run_dir, "vllm", tmp_path_factory.mktemp("good") / "vllm")


def test_check_passes_on_an_export(run_dir, good_export, capsys):
    assert main(["export", "--drafter", str(run_dir), "--out", str(good_export), "--check"]) == 0
    assert "matches drafter" in capsys.readouterr().out


@pytest.mark.parametrize("name, change, needle", BROKEN, ids=[b[0] for b in BROKEN])
def test_check_catches_a_broken_export_in_one_line(name, change, needle, run_dir, good_export, tmp_path, capsys):
    bad = _broken(good_export, tmp_path, name, **change)
    assert main(["export", "--drafter", str(run_dir), "--out", str(bad), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_check_against_a_store_of_another_layer_convention(run_dir, source, tmp_path, capsys):
    """A store captured with the ids off by one (another engine's convention) does not fit the export."""
    from hstap.config import TeacherSpec
    from hstap.store import StoreMeta, StoreWriter

    cfg, _ = source
    out = export_drafter(run_dir, "sglang", tmp_path / "e")
    for ids, code in (([1, 14, 26], 0), ([2, 15, 27], 2)):
        meta = StoreMeta(model_id="x", model_fingerprint=cfg.target_fingerprint, layer_ids=ids, hidden_size=576,
                         hidden_dtype="bf16", teacher=TeacherSpec())
        StoreWriter(tmp_path / f"store{ids[0]}", meta).close()
        argv = ["export", "--drafter", str(run_dir), "--out", str(out), "--check", "--store",
                str(tmp_path / f"store{ids[0]}")]
        assert main(argv) == code
        err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sglang would feed target layers [1, 14, 26], the store" in err
    assert "holds [2, 15, 27]" in err


def test_every_export_is_checked_before_it_appears(run_dir, tmp_path, monkeypatch):
    """An exporter that writes vLLM's ids in the canonical convention (the classic off-by-one) is caught while
    writing: nothing appears at --out, no temp directory is left."""
    import hstap.export.formats as formats

    monkeypatch.setattr(formats, "_vllm_id", lambda k: k)
    with pytest.raises(HstapError, match=r"does not read back as the drafter, nothing written to .*: config.json: "
                                         r"vllm would feed the drafter target layers \[0, 13, 25\]"):
        export_drafter(run_dir, "vllm", tmp_path / "e")
    assert list(tmp_path.iterdir()) == []


def test_a_really_full_disk_is_one_line_and_leaves_nothing(run_dir, tiny_disk, capsys):
    """A 64 KB tmpfs: safetensors reports ENOSPC as its own SafetensorError (a traceback before 2026-12)."""
    assert main(["export", "--drafter", str(run_dir), "--format", "sglang", "--out", str(tiny_disk / "e")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "nothing was written" in err, err
    assert list(tiny_disk.iterdir()) == []


def test_a_shipped_drafter_exports_by_name(tmp_path, capsys):
    """`--drafter reference` names the drafter `hstap eval --drafter reference` evaluates (hstap.drafter.shipped):
    export and check take the name too, not only a run directory (tests/live/test_vllm_eagle.py serves it)."""
    out = tmp_path / "ref-vllm"
    assert main(["export", "--drafter", "reference", "--format", "vllm", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["draft_vocab_size"] == 16384
    assert main(["export", "--drafter", "reference", "--out", str(out), "--check"]) == 0
    assert "matches drafter reference" in capsys.readouterr().out
