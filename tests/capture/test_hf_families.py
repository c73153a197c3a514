"""The transformers path on tiny random-weight models of every family hstap's table lists, built from transformers'
own config classes: the embedded taps equal `output_hidden_states[k + 1]` (the canonical layer id) on a padded
batch, the teacher equals the post-norm last entry, and the saved config.json resolves to a known row in both
engine tables (so `hstap sglang-flags` / the vLLM extension name real modules for it)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hstap.capture.arch import resolve_layout
from hstap.capture.hf import hf_taps
from hstap.capture.tap import Batch, Tap
from hstap.config import TeacherSpec

TINY = dict(vocab_size=96, pad_token_id=0, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# (config class, model class, family-specific settings)
FAMILIES = [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("MistralConfig", "MistralForCausalLM", {}),
    ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(MOE, num_experts=4, shared_expert_intermediate_size=32)),
    ("Qwen3Config", "Qwen3ForCausalLM", {}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4)),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # Kimi-K2's text model: first layer dense, MoE after
     dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
          q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)),
    ("Glm4Config", "Glm4ForCausalLM", {}),
    ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                                 n_group=1, topk_group=1)),
    ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    ("Gemma2Config", "Gemma2ForCausalLM", {}),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8)),
]


def _tiny(config_cls: str, model_cls: str, extra: dict):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    config.architectures = [model_cls]
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("config_cls, model_cls, extra", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_taps_equal_output_hidden_states(config_cls, model_cls, extra, tmp_path):
    model = _tiny(config_cls, model_cls, extra)
    ids = torch.randint(1, TINY["vocab_size"], (2, 9))  # (B, S)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # the second sample is 6 tokens, right-padded
    got: dict[str, dict[str, torch.Tensor]] = {}
    tap = Tap({"hidden.0", "hidden.1", "teacher"}, sink=lambda sid, t: got.__setitem__(sid, t),
              storage_dtype=torch.float32, teacher=TeacherSpec(kind="hidden", k=0), hidden_size=TINY["hidden_size"])
    with torch.no_grad(), hf_taps(model, tap, [0, 1], teacher_kind="hidden"):
        tap.begin(Batch(ids=["a", "b"], rows=[0, 1], starts=[0, 0], lengths=[9, 6]))
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        tap.end()
    assert tap.close().errors == 0
    hs = out.hidden_states  # (L + 1) x (B, S, H); entry k + 1 = canonical layer k, the last entry post-norm
    for row, (sid, n) in enumerate([("a", 9), ("b", 6)]):
        for k in (0, 1):
            torch.testing.assert_close(got[sid][f"hidden.{k}"], hs[k + 1][row, :n], rtol=0, atol=0)
        torch.testing.assert_close(got[sid]["teacher.hidden"], hs[-1][row, :n], rtol=0, atol=0)
    model.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for engine in ("sglang", "vllm"):
        layout = resolve_layout(config, engine)
        assert layout.known and layout.architecture == model_cls, (engine, layout)
