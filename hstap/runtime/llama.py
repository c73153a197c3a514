"""A lean forward of a Llama-family target (Llama, Mistral without sliding window, Qwen2, SmolLM2) over `KVCache`.

transformers' forward launches ~50 small kernels per decoder layer (a norm is eight: upcast, square, mean, add,
rsqrt, multiply, downcast, scale); a replayed CUDA graph still pays ~2 µs for each. This forward reads the same
weights, fused once at load (q/k/v into one matrix, gate/up into one), and uses one `rms_norm`, one SDPA call
over the cache (attention.py) and in-place cache writes: about 20 kernels per layer. It runs the prefill too
(`Runtime`'s default; `last_only` keeps its lm_head to the last position), so nothing but the weights is shared
with the transformers model, which stays what it was: hooks on it see only a `Runtime(prefill="model")` prefill.

    lean = LeanLlama(model)                      # HstapError when the architecture is not supported
    logits, aux = lean.forward(ids, positions, kv, cols, mask, aux_layers=[1, 14, 26])

Numerics: fp32 matches transformers to rounding (tests compare logits and greedy output); in bf16 the fused norm
rounds once where transformers rounds twice, so bf16 logits differ from transformers' by a rounding step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from hstap.errors import HstapError
from hstap.runtime.attention import cache_attention, group_mask, grouped_o, rope_tables, rotary_qk
from hstap.runtime.kv import KV_WRITES, KVCache
from hstap.runtime.linear import ProductChoice, Projection, choose_products, wants_reorder

T = TypeVar("T")


@dataclass
class _Layer:
    ln1: torch.Tensor  # (H,)
    qkv: Projection  # ((nh + 2·nkv)·hd, H)
    o: Projection  # (H, nh·hd), input columns in cache_attention's head order (attention.grouped_o)
    ln2: torch.Tensor
    gate_up: Projection | None  # (2·I, H), the "chunk" form; None in the "batched" form
    gate_up_stacked: torch.Tensor | None  # (2, H, I), the "batched" form; None in the "chunk" form
    down: Projection  # (H, I)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `LeanLlama` cannot run `model`, or None when it can."""
    cfg = model.config
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} is not a decoder-only model with model.layers and lm_head"
    attn, mlp = layers[0].self_attn, layers[0].mlp
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or hasattr(attn, "q_norm"):
        return f"{type(model).__name__}: attention is not Llama's (q/k/v/o projections, no q/k norms)"
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) or cfg.hidden_act != "silu":
        return f"{type(model).__name__}: the MLP is not Llama's gated SiLU"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"{type(model).__name__}: sliding-window attention is not supported"
    return None


def _bias(*modules) -> torch.Tensor | None:
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in modules])


_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {key: (parameter state, weights)}


def fused_weights(model: torch.nn.Module, key: tuple, fuse: Callable[[], T]) -> T:
    """`fuse()`'s weights for `model` and `key`, made once and reused while the model's parameters are the same
    tensors at the same versions (an in-place update or a move makes them again). Synth, the engine, evaluation
    and the tests build a runtime per batch, request or test over one model: each fused every layer again and,
    on a CPU, reordered 538 MB of weights for oneDNN (0.2 s alone, 4-11 s beside a second pytest worker)."""
    try:
        state = tuple((p.data_ptr(), p._version) for p in model.parameters())
    except RuntimeError:  # inference tensors keep no version: nothing tells a changed weight, so no reuse
        return fuse()
    per_model = _FUSED.setdefault(model, {})
    if key not in per_model or per_model[key][0] != state:
        per_model[key] = (state, fuse())
    return per_model[key][1]


MLP_FORMS = ("chunk", "batched")


def mlp_form_for(device: torch.device, has_bias: bool) -> str:
    """The MLP form measured faster on `device` (bench/verify_cost.py section 5; the figures in lab/logs). On
    CUDA batched: from two rows on, the chunk form's silu and product read half-rows and run CUDA's generic
    strided kernel (section 4's census), and verification blocks have several rows; at one row the two tie. On a
    CPU batched is slower at one and two rows, where decoding lives, so the CPU keeps the chunk form. A biased MLP
    keeps it too (the batched GEMM has no bias term)."""
    return "batched" if device.type == "cuda" and not has_bias else "chunk"


def gated_mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)) for x (B, Q, H) → (B, Q, H), in the layer's form. "batched": one batched GEMM
    of two (gate and up) whose halves are contiguous at any Q; "chunk": one GEMM whose output rows hold gate then
    up, contiguous halves only at one row."""
    if layer.gate_up_stacked is not None:
        rows = x.reshape(-1, x.shape[-1])  # (M, H)
        both = torch.bmm(rows.expand(2, *rows.shape), layer.gate_up_stacked)  # (2, M, I)
        return layer.down(F.silu(both[0]) * both[1]).view(*x.shape[:-1], -1)
    gate, up = layer.gate_up(x).chunk(2, dim=-1)  # (B, Q, I) each
    return layer.down(F.silu(gate) * up)


class LeanLlama:
    """The target's forward over a static cache, from fused copies of its weights (made once). `mlp_form`:
    "chunk" or "batched" (`gated_mlp`); None picks the one measured faster on the weights' device. `kv_write`: the
    caches' write form (`kv.KVCache`). `reorder`: whether the projections keep oneDNN's copy of their weights, used
    at the row counts where it measures faster (`hstap.runtime.linear`; None: for fp32 weights on a CPU)."""

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, mlp_form: str | None = None, kv_write: str = "scatter",
                 reorder: bool | None = None):
        reason = unsupported(model)
        if reason is not None:
            raise HstapError(f"the decoding runtime runs Llama-family targets only: {reason}")
        if mlp_form not in (None, *MLP_FORMS):
            raise ValueError(f"mlp_form must be one of {', '.join(MLP_FORMS)} or None, got {mlp_form!r}")
        if kv_write not in KV_WRITES:
            raise ValueError(f"kv_write must be one of {', '.join(KV_WRITES)}, got {kv_write!r}")
        self.kv_write = kv_write
        cfg, inner = model.config, model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = inner.norm.variance_epsilon
        self.scale = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = float(inner.rotary_emb.attention_scaling)
        self.norm = inner.norm.weight
        mlp = inner.layers[0].mlp
        self.mlp_form = mlp_form or mlp_form_for(self.embed.device, _bias(mlp.gate_proj, mlp.up_proj) is not None)
        reorder = wants_reorder(self.embed, reorder)  # resolved here: the key of the fused weights' cache

        def fuse() -> tuple[Projection, list[_Layer]]:
            return (Projection(model.lm_head.weight, reorder=reorder),
                    [self._fuse(layer, self.heads, self.kv_heads, self.mlp_form, reorder) for layer in inner.layers])

        self.lm_head, self.layers = fused_weights(model, (self.mlp_form, reorder), fuse)
        # which product each row count takes, measured on these weights (linear.choose_products): the one-token
        # step and the verification blocks by one rule
        self.products: ProductChoice | None = choose_products(self.projections)

    @property
    def projections(self) -> list[Projection]:
        """Every projection of a forward, in the order it runs them (the lm_head last)."""
        layers = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down) if p]
        return [*layers, self.lm_head]

    @property
    def reordered_bytes(self) -> int:
        """Bytes of the projections' oneDNN copies (0 where there are none)."""
        return sum(p.extra_bytes for p in self.projections)

    @staticmethod
    def _fuse(layer, heads: int, kv_heads: int, mlp_form: str, reorder: bool | None) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        gate_up_bias = _bias(m.gate_proj, m.up_proj)
        if mlp_form == "batched" and gate_up_bias is not None:
            raise HstapError("the batched MLP form has no bias term: this target's gate/up projections have biases")
        stacked = mlp_form == "batched"  # one copy of the weights either way: (2, H, I) or (2·I, H)
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
        gate_up = None if stacked else torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
        return _Layer(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                      qkv=Projection(qkv, _bias(a.q_proj, a.k_proj, a.v_proj), reorder),
                      o=Projection(grouped_o(a.o_proj.weight, heads, kv_heads), a.o_proj.bias, reorder),
                      gate_up=None if gate_up is None else Projection(gate_up, gate_up_bias, reorder),
                      down=Projection(m.down_proj.weight, m.down_proj.bias, reorder),
                      gate_up_stacked=torch.stack([m.gate_proj.weight.t(), m.up_proj.weight.t()]).contiguous()
                      if stacked else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the KV cache `new_cache(batch, length)` allocates (keys and values of every layer)."""
        return 2 * self.num_layers * batch * self.kv_heads * length * self.head_dim * self.dtype.itemsize

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(self.num_layers, batch, self.kv_heads, length, self.head_dim, self.dtype, self.embed.device,
                       self.kv_write)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, cols: torch.Tensor,
                mask: torch.Tensor, aux_layers: list[int] | tuple[int, ...] = (), last_only: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions, cols (B, Q); mask (B, 1, Q, S) from `kv.block_mask` over the first S ≤ L columns
        (S < L: attend to a prefix of the cache, what the eager path does to skip empty columns) → (logits
        (B, Q, V) in the model dtype, the residual stream after each of `aux_layers` concatenated (B, Q, n·H),
        or None). `last_only`: logits of the last query only, (B, 1, V): a prefill needs just the next token's,
        and 256 rows x 4k tokens of full logits would be ~200 GB."""
        h = F.embedding(ids, self.embed)  # (B, Q, H)
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scale, h.dtype)  # (B, Q, hd)
        mask = group_mask(mask, self.heads // self.kv_heads)  # (B, 1, Q·G, L)
        index = kv.write_index(cols)  # (B, H_kv, Q, hd)
        aux = []
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, F.rms_norm(h, h.shape[-1:], layer.ln1, self.eps), cos, sin, kv,
                                    index, mask)
            h = h + gated_mlp(layer, F.rms_norm(h, h.shape[-1:], layer.ln2, self.eps))
            if i in aux_layers:
                aux.append(h)
        if last_only:
            h = h[:, -1:]  # (B, 1, H); aux keeps every position
        logits = self.lm_head(F.rms_norm(h, h.shape[-1:], self.norm, self.eps))  # (B, Q or 1, V)
        order = sorted(set(aux_layers))
        return logits, (torch.cat([aux[order.index(k)] for k in aux_layers], -1) if aux_layers else None)

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv: KVCache, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(x).view(b, s, nh + 2 * nkv, hd)  # (B, Q, nh+2nkv, hd)
        rows, k = rotary_qk(qkv, nh, nkv, cos, sin)  # (B, nkv, Q·G, hd), (B, Q, nkv, hd)
        kv.write(i, index, k.transpose(1, 2), qkv[:, :, nh + nkv:].transpose(1, 2))  # (B, nkv, Q, hd)
        span = mask.shape[-1]
        out = cache_attention(rows, kv.keys(i)[:, :, :span], kv.values(i)[:, :, :span], mask, self.scale,
                              s)  # (B, Q, nh·hd)
        return layer.o(out)
