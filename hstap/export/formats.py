"""What each engine's EAGLE-3 draft loader reads: config keys, tensor names, and its layer-id convention.

    from hstap.export.formats import FORMATS, sglang_layer_ids, vllm_layer_ids
    sglang_layer_ids([1, 14, 26], 30)   # [1, 14, 26]: SGLang adds 1 itself
    vllm_layer_ids([1, 14, 26], 30)     # [2, 15, 27]

Checked against SGLang 0.5.23 and vLLM 0.33.0 (docs/export.md lists the files read). Both engines load the same
layout: architecture `LlamaForCausalLMEagle3`, tensors `fc.weight`, `midlayer.*` (both loaders rename it to
`layers.0.*` themselves), `norm.weight`, `lm_head.weight`, `d2t` (offsets), `t2d` (skipped by both), and no
embedding (both share the target's). They differ in where they read the auxiliary layer ids and what an id
means: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 (= canonical k); vLLM reads the
top-level `eagle_aux_hidden_state_layer_ids` as is (= k + 1), and its V1 runner falls back to the eagle_config
key, in its own convention. Every export therefore writes both keys, each in its reader's convention, so a
checkpoint is never read off by one, whichever engine serves it; a format adds only its engine's checks.
"""

from __future__ import annotations

from typing import Callable

import torch

from hstap.config import torch_dtype, torch_name
from hstap.drafter.config import DrafterConfig
from hstap.errors import HstapError

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang registers only this name; vLLM maps it to Eagle3LlamaForCausalLM
CHECKED_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
EMBEDDING = "embed_tokens.weight"


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an export holds (the embedding aside), with its shape, from the drafter's config."""
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inter, m = cfg.intermediate_size, "midlayer."
    return {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        m + "input_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        m + "self_attn.q_proj.weight": (nh * hd, 2 * h),  # attention reads concat(embed, hidden): 2H
        m + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
        m + "self_attn.v_proj.weight": (nkv * hd, 2 * h),
        m + "self_attn.o_proj.weight": (h, nh * hd),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (inter, h),
        m + "mlp.up_proj.weight": (inter, h),
        m + "mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


# ---- layer ids --------------------------------------------------------------------------------------------------

def _check_canonical(canonical: list[int], num_layers: int, highest: int, engine: str) -> None:
    if not canonical:
        raise HstapError("aux_layer_ids is empty: an EAGLE-3 drafter reads at least one target layer")
    if any(b <= a for a, b in zip(canonical, canonical[1:])):
        # both engines collect aux states in layer order (vLLM even sorts and dedups the ids), so fc's input
        # chunks would silently arrive in another order than the drafter was trained on
        raise HstapError(f"aux_layer_ids={canonical}: {engine} concatenates target layers in increasing order; "
                         "the ids must be strictly increasing (retrain with sorted ids)")
    bad = [k for k in canonical if not 0 <= k <= highest]
    if bad:
        raise HstapError(f"aux_layer_ids {bad} out of range for {engine} with a {num_layers}-layer target: "
                         f"expected canonical ids 0..{highest}")


def _sglang_id(k: int) -> int:
    return k  # SGLang's set_eagle3_layers_to_capture adds the 1 itself


def _vllm_id(k: int) -> int:
    return k + 1  # vLLM id 0 is the embedding output, id j the stream after layer j-1


def sglang_layer_ids(canonical: list[int], num_layers: int) -> list[int]:
    """Canonical ids → SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`.

    SGLang's `set_eagle3_layers_to_capture` adds 1 and captures the residual entering that layer, i.e. the stream
    after layer k: the config id is the canonical id. The last layer (k = L-1) has no next layer whose entry
    could capture it, so SGLang cannot read it.
    """
    _check_canonical(canonical, num_layers, num_layers - 2, "SGLang")
    return [_sglang_id(k) for k in canonical]


def vllm_layer_ids(canonical: list[int], num_layers: int) -> list[int]:
    """Canonical ids → vLLM's `eagle_aux_hidden_state_layer_ids`: vLLM id j is the stream after layer j-1."""
    _check_canonical(canonical, num_layers, num_layers - 1, "vLLM")
    return [_vllm_id(k) for k in canonical]


# ---- formats -----------------------------------------------------------------------------------------------------

def draft_config(cfg: DrafterConfig, dtype: str) -> dict:
    """The Llama-shaped draft config both loaders build their model from (transformers `LlamaConfig` keys)."""
    canonical = cfg.aux_layer_ids
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,  # layer 0 is the EAGLE-3 input layer (2H attention input)
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",  # the drafter's MLP is SiLU-gated (hstap.drafter.model.MLP)
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers 5 (which both engines require) reads rope_parameters; rope_theta is for older readers
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        # True would make SGLang use the embedding as lm_head (full vocabulary) instead of the trained head
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": len(canonical),  # fc's input width; both loaders read it before anything else
        "dtype": torch_name(dtype),  # the HF config spelling (bfloat16), which both engines read
        # SGLang reads its ids only here; vLLM's V1 runner reads here only when the top-level key is absent
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [_sglang_id(k) for k in canonical]},
        # vLLM (both model runners) reads this first; SGLang's Llama EAGLE-3 path never reads it
        "eagle_aux_hidden_state_layer_ids": [_vllm_id(k) for k in canonical],
    }


def draft_tensors(cfg: DrafterConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
             include_embedding: bool) -> dict[str, torch.Tensor]:
    """The run's tensors, floats cast to the export dtype; d2t stays int64, t2d bool."""
    out = {}
    for name in expected_shapes(cfg):
        tensor = state[name]
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if cfg.draft_vocab_size == cfg.vocab_size:
        # identity maps: vLLM 0.33.0 builds no d2t parameter for a full vocabulary and rejects the name
        del out["d2t"], out["t2d"]
    if include_embedding:
        out[EMBEDDING] = state[EMBEDDING].to(dtype)
    return {name: t.contiguous() for name, t in out.items()}


def _export(cfg: DrafterConfig, state: dict[str, torch.Tensor], dtype: str, include_embedding: bool,
            layer_ids: Callable[[list[int], int], list[int]]) -> tuple[dict, dict[str, torch.Tensor]]:
    layer_ids(cfg.aux_layer_ids, cfg.target_num_layers)  # refuses ids this engine cannot capture
    return draft_config(cfg, dtype), draft_tensors(cfg, state, torch_dtype(dtype), include_embedding)


def export_sglang(cfg: DrafterConfig, state: dict[str, torch.Tensor], dtype: str = "bf16",
                  include_embedding: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """SGLang `LlamaForCausalLMEagle3`: config dict and tensors; refuses ids SGLang cannot capture."""
    return _export(cfg, state, dtype, include_embedding, sglang_layer_ids)


def export_vllm(cfg: DrafterConfig, state: dict[str, torch.Tensor], dtype: str = "bf16",
                include_embedding: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM `Eagle3LlamaForCausalLM` (via `LlamaForCausalLMEagle3`): config dict and tensors."""
    return _export(cfg, state, dtype, include_embedding, vllm_layer_ids)


FORMATS = {"sglang": export_sglang, "vllm": export_vllm}


def get_format(name: str) -> Callable[..., tuple[dict, dict[str, torch.Tensor]]]:
    try:
        return FORMATS[name]
    except KeyError:
        raise HstapError(f"unknown export format {name!r}: expected one of {', '.join(FORMATS)}") from None
