"""The real SmolLM2 weights behind SGLang's and vLLM's module trees and layer contracts, driven by batch objects.

SGLang's model files and `forward_batch_info` need a GPU stack to import (torchvision built for CUDA torch,
tvm_ffi, ...), so this mirrors what the hooks can observe, with the names the real code uses:

- module names `model.layers.<i>`, `model.layers.<i>.input_layernorm`, `model.norm` (LlamaForCausalLM.model);
- RMSNorm's `forward(x, residual=None)`: with a residual, `residual += x; x = norm(residual)` *in place* (the fused
  add-RMSNorm kernel) and returns `(x, residual)`;
- the decoder-layer contracts of SGLang 0.5.23 (hstap.capture.arch names them):
  `pairs`:       `forward(positions, hidden_states, forward_batch, residual) -> (hidden_states, residual)`, the
                 residual add deferred to the next norm (Gemma-2, ...);
  `stream`:      `forward(positions, hidden_states, forward_batch, capture_output=None) -> hidden_states`, the
                 residual held in `forward_batch.residual_stream` (Llama, Qwen in 0.5.23);
  `stream_topk`: the same, returning `(hidden_states, topk_indices)` (DeepSeek, Kimi; the indices are an integer
                 tensor on the sparse-attention models);
- a wrapper that holds the causal LM as `language_model`, as Kimi-K2.5 does (`SgWrapped`);
- vLLM 0.33's contract `forward(positions, hidden_states, residual) -> (hidden_states, residual)`, the batch layout
  coming from the forward context (here `VLLM_CONTEXT`), the model called as `model(input_ids=..., positions=...)`;
- a packed `[T, H]` batch with per-request `extend_seq_lens_cpu` / `extend_prefix_lens_cpu`, positions, and a
  per-request KV cache so chunked prefill and prefix-cache hits attend to tokens computed earlier.

`ForwardMode` is built from the member names parsed out of the installed SGLang's own source, so its values are
the real ones; `forward_batch_fields()` returns the real ForwardBatch's field names for the tests to check against.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv


def _sglang_source(rel: str) -> ast.Module:
    spec = importlib.util.find_spec("sglang")
    root = Path(list(spec.submodule_search_locations)[0])
    return ast.parse((root / rel).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


FBI = "srt/model_executor/forward_batch_info.py"


def _forward_mode_names() -> list[str]:
    if importlib.util.find_spec("sglang") is None:  # the vLLM tests run without SGLang: 0.5.23's order
        return ["EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND_V2", "PREBUILT", "SPLIT_PREFILL",
                "DLLM_EXTEND"]
    return [t.id for n in _class(_sglang_source(FBI), "ForwardMode").body
            if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]


ForwardMode = IntEnum("ForwardMode", _forward_mode_names())


def forward_batch_fields() -> set[str]:
    return {n.target.id for n in _class(_sglang_source(FBI), "ForwardBatch").body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


class ResidualStream:
    """forward_batch.residual_stream's role in 0.5.23: the residual, kept off the layer's return value."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None


@dataclass
class FB:
    """The ForwardBatch fields the hooks read (names as in SGLang), plus `kv`, this test model's cache."""

    forward_mode: IntEnum
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None
    rids: list[str] | None
    residual_stream: ResidualStream | None = None
    # test-model only: per-request (new tokens, cached tokens) even for decode, where SGLang has no extend lens
    lens: list[int] = field(default_factory=list)
    prefixes: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


class SgRMSNorm(nn.Module):
    def __init__(self, hf_norm: nn.Module) -> None:
        super().__init__()
        self.weight = hf_norm.weight
        self.eps = hf_norm.variance_epsilon

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual.add_(x)  # in place, like sgl_kernel.fused_add_rmsnorm
        x.copy_(self._norm(residual))
        return x, residual


class SgAttention(nn.Module):
    def __init__(self, hf_attn: nn.Module, config, layer_id: int, kv: dict) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj,
                                                              hf_attn.o_proj)
        self.nh, self.nkv = config.num_attention_heads, config.num_key_value_heads
        self.hd = getattr(config, "head_dim", None) or config.hidden_size // self.nh
        self.layer_id, self.kv = layer_id, kv
        self.rotary = None  # set by the model (shared)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: FB) -> torch.Tensor:
        t = x.shape[0]
        if t == 0:  # an IDLE pass (DP attention with nothing scheduled on this rank)
            return self.o_proj(x)
        q = self.q_proj(x).view(t, self.nh, self.hd).transpose(0, 1)[None]  # (1, nh, T, hd)
        k = self.k_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)[None]  # (1, nkv, T, hd)
        v = self.v_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)[None]
        cos, sin = self.rotary(x[None], positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs, start = [], 0
        for key, n, prefix in zip(fb.keys, fb.lens, fb.prefixes):
            cache = self.kv.setdefault(key, {})
            pk, pv = cache.get(self.layer_id, (k[:, :, :0], v[:, :, :0]))
            assert pk.shape[2] == prefix, f"request {key}: cache holds {pk.shape[2]} tokens, batch says {prefix}"
            kk = torch.cat([pk, k[:, :, start:start + n]], dim=2)  # (1, nkv, P+n, hd)
            vv = torch.cat([pv, v[:, :, start:start + n]], dim=2)
            cache[self.layer_id] = (kk, vv)
            allowed = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]  # (n, P+n)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start:start + n], repeat_kv(kk, self.nh // self.nkv), repeat_kv(vv, self.nh // self.nkv),
                attn_mask=allowed)  # (1, nh, n, hd)
            outs.append(o[0].transpose(0, 1).reshape(n, self.nh * self.hd))
            start += n
        return self.o_proj(torch.cat(outs))


class PairsLayer(nn.Module):
    """`forward(positions, hidden_states, forward_batch, residual) -> (hidden_states, residual)`."""

    def __init__(self, hf_layer, config, layer_id: int, kv: dict) -> None:
        super().__init__()
        self.input_layernorm = SgRMSNorm(hf_layer.input_layernorm)
        self.self_attn = SgAttention(hf_layer.self_attn, config, layer_id, kv)
        self.post_attention_layernorm = SgRMSNorm(hf_layer.post_attention_layernorm)
        self.mlp = hf_layer.mlp

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class StreamLayer(PairsLayer):
    """`forward(positions, hidden_states, forward_batch, capture_output=None) -> hidden_states` (0.5.23 Llama)."""

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        stream = forward_batch.residual_stream
        if stream.residual is None:
            stream.residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, stream.residual = self.input_layernorm(hidden_states, stream.residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, stream.residual = self.post_attention_layernorm(hidden_states, stream.residual)
        return self.mlp(hidden_states)


class StreamTopkLayer(StreamLayer):
    """DeepSeek's `-> (hidden_states, topk_indices)`: here the indexer's choice is a (T, 8) int32 tensor of
    plausible key positions, exactly what must never be added to the hidden state."""

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        hidden_states = super().forward(positions, hidden_states, forward_batch, capture_output)
        topk_indices = (positions[:, None] - torch.arange(8)).clamp(min=0).to(torch.int32)  # (T, 8)
        return hidden_states, topk_indices


VLLM_CONTEXT: list = [None]  # the batch of the forward in flight, as vLLM's forward context would hold it


class VllmLayer(PairsLayer):
    """vLLM: `forward(positions, hidden_states, residual) -> (hidden_states, residual)`."""

    def forward(self, positions, hidden_states, residual):
        return super().forward(positions, hidden_states, VLLM_CONTEXT[0], residual)


class SgModel(nn.Module):
    def __init__(self, hf_model, contract: str, kv: dict) -> None:
        super().__init__()
        cfg = hf_model.config
        layer_cls = {"pairs": PairsLayer, "stream": StreamLayer, "stream_topk": StreamTopkLayer,
                     "vllm": VllmLayer}[contract]
        self.contract = contract
        self.embed_tokens = hf_model.model.embed_tokens
        self.layers = nn.ModuleList(layer_cls(l, cfg, i, kv) for i, l in enumerate(hf_model.model.layers))
        self.norm = SgRMSNorm(hf_model.model.norm)
        rotary = hf_model.model.rotary_emb
        for layer in self.layers:
            layer.self_attn.rotary = rotary

    def forward(self, input_ids, positions, forward_batch, inputs_embeds=None):
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (T, H)
        if self.contract in ("stream", "stream_topk"):
            forward_batch.residual_stream = ResidualStream()
            for layer in self.layers:
                hidden_states = layer(positions, hidden_states, forward_batch)
                if self.contract == "stream_topk":
                    hidden_states, _ = hidden_states
            hidden_states, _ = self.norm(hidden_states, forward_batch.residual_stream.residual)
            forward_batch.residual_stream = None
            return hidden_states
        residual = None
        for layer in self.layers:
            if self.contract == "vllm":
                hidden_states, residual = layer(positions, hidden_states, residual)
            else:
                hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SgCausalLM(nn.Module):
    """`LlamaForCausalLM`: `.model` + a tied lm_head applied, like SGLang's logits processor, to each request's
    last token only."""

    def __init__(self, hf_model, contract: str = "stream") -> None:
        super().__init__()
        self.kv: dict = {}
        self.model = SgModel(hf_model, contract, self.kv)
        self.lm_head = hf_model.get_output_embeddings()

    @torch.inference_mode()
    def forward(self, fb: FB) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)  # (T, H)
        last = torch.tensor(list(torch.cumsum(torch.tensor(fb.lens), 0) - 1)) if fb.lens else torch.zeros(0).long()
        return self.lm_head(hidden[last])  # (bs, V)


class SgWrapped(nn.Module):
    """A multimodal wrapper's module tree (KimiK25ForConditionalGeneration: `vision_tower`, `mm_projector`,
    `language_model` = the causal LM), served text-only. The vision tower has `layers` of its own: a pattern that
    is not anchored at `language_model.model` would hit them."""

    def __init__(self, hf_model, contract: str = "stream_topk") -> None:
        super().__init__()
        self.vision_tower = nn.Module()
        self.vision_tower.layers = nn.ModuleList(nn.Identity() for _ in range(4))
        self.mm_projector = nn.Identity()
        self.language_model = SgCausalLM(hf_model, contract)
        self.kv = self.language_model.kv

    def forward(self, fb: FB) -> torch.Tensor:
        return self.language_model(fb)


def extend_batch(reqs: list[tuple[str, list[int], int]], mode=None, rids: bool = True) -> FB:
    """A prefill batch: `reqs` = (request id, new token ids, tokens already cached)."""
    ids = [t for _, toks, _ in reqs for t in toks]
    pos = [p + j for _, toks, p in reqs for j in range(len(toks))]
    return FB(forward_mode=mode or ForwardMode.EXTEND, input_ids=torch.tensor(ids), positions=torch.tensor(pos),
              extend_seq_lens_cpu=[len(t) for _, t, _ in reqs], extend_prefix_lens_cpu=[p for _, _, p in reqs],
              rids=[r for r, _, _ in reqs] if rids else None, lens=[len(t) for _, t, _ in reqs],
              prefixes=[p for _, _, p in reqs], keys=[r for r, _, _ in reqs])


def decode_batch(reqs: list[tuple[str, int, int]]) -> FB:
    """A decode batch: `reqs` = (request id, next token, tokens cached); SGLang has no extend lens here."""
    return FB(forward_mode=ForwardMode.DECODE, input_ids=torch.tensor([t for _, t, _ in reqs]),
              positions=torch.tensor([p for _, _, p in reqs]), extend_seq_lens_cpu=None, extend_prefix_lens_cpu=None,
              rids=[r for r, _, _ in reqs], lens=[1] * len(reqs), prefixes=[p for _, _, p in reqs],
              keys=[r for r, _, _ in reqs])


class VllmCausalLM(nn.Module):
    """vLLM's `LlamaForCausalLM` shape: `model(input_ids=..., positions=...)` returns the hidden states (T, H)."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        self.kv: dict = {}
        self.model = SgModel(hf_model, "vllm", self.kv)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, VLLM_CONTEXT[0])


class VllmWrapped(nn.Module):
    """vLLM's KimiK25ForConditionalGeneration shape: the causal LM as `language_model`, called as a multimodal model
    is by vLLM's v1 runners — `input_ids=None` and `inputs_embeds` that the runner computed beforehand through
    the text model's `embed_tokens` (see `vllm_step(..., embeds=True)`)."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        self.vision_tower = nn.Identity()
        self.language_model = VllmCausalLM(hf_model)
        self.kv = self.language_model.kv

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, VLLM_CONTEXT[0], inputs_embeds)


VLLM_INFO: list = [None]  # what vllm.forward_context's attention metadata says about the forward in flight


def vllm_step(model: nn.Module, reqs: list[tuple[str, list[int], int]], embeds: bool = False) -> torch.Tensor:
    """One vLLM forward: decodes (one token each) first, then prefills, as vLLM orders them. While it runs,
    `VLLM_INFO[0]` holds the host-side attention-metadata facts (`max_query_len`, `num_actual_tokens`,
    `num_decode_tokens`)."""
    lens = [len(t) for _, t, _ in reqs]
    decodes = 0
    while decodes < len(reqs) and lens[decodes] == 1 and reqs[decodes][2] > 0:
        decodes += 1
    fb = extend_batch(reqs)
    VLLM_CONTEXT[0] = fb
    VLLM_INFO[0] = {"max_query_len": max(lens), "num_actual_tokens": sum(lens), "num_decode_tokens": decodes}
    try:
        if embeds:  # the runner embeds the scheduled tokens first, then runs the model on the embeddings
            with torch.inference_mode():
                inputs_embeds = model.embed_input_ids(fb.input_ids)
            return model(input_ids=None, positions=fb.positions, inputs_embeds=inputs_embeds)
        return model(input_ids=fb.input_ids, positions=fb.positions)
    finally:
        VLLM_CONTEXT[0] = VLLM_INFO[0] = None


def skeleton(layout, num_layers: int, first_dense: int = 1) -> nn.Module:
    """An empty module tree with the names an engine's model of this layout has (no weights): a multimodal wrapper
    (`vision_tower` with `layers` of its own, `mm_projector`), the causal LM (`lm_head`), the text model
    (`embed_tokens`, `layers`, `norm`), and per layer the norms, attention and a dense MLP for the first
    `first_dense` layers, MoE experts after (DeepSeek-V3/Kimi's `first_k_dense_replace`)."""
    root = nn.Module()
    root.vision_tower = nn.Module()
    root.vision_tower.layers = nn.ModuleList(nn.Identity() for _ in range(4))
    root.mm_projector = nn.Identity()
    text = root
    path = layout.text[0].split(".")
    for depth, attr in enumerate(path):
        child = nn.Module()
        setattr(text, attr, child)
        if depth == len(path) - 2:
            child.lm_head = nn.Identity()
        text = child
    setattr(text, layout.embed, nn.Identity())
    setattr(text, layout.norm, nn.Identity())
    layers = nn.ModuleList()
    for i in range(num_layers):
        layer = nn.Module()
        setattr(layer, layout.input_norm, nn.Identity())
        layer.self_attn, layer.post_attention_layernorm = nn.Identity(), nn.Identity()
        layer.mlp = nn.Identity() if i < first_dense else nn.ModuleDict({"gate": nn.Identity(),
                                                                          "experts": nn.Identity()})
        layers.append(layer)
    setattr(text, layout.layers, layers)
    return root
