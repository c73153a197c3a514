"""The EAGLE-3 draft model.

    h0      = fc(concat(aux_1, aux_2, aux_3))                      (B, S, 3H) -> (B, S, H)
    x       = concat(input_norm(embed(token)), hidden_norm(h))     (B, S, 2H)
    h'      = h + attn(x);  h'' = h' + mlp(post_norm(h'))          one Llama-style decoder layer
    logits  = lm_head(norm(h''))                                   (B, S, draft_vocab)

`h''` (pre-norm) is what the next draft step reads instead of `h0`. The embedding is the target's, frozen.
Parameter names are the ones SGLang's `LlamaForCausalLMEagle3` loads (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so export is a rename-free copy. Attention is passed in as a function: training-time test, chain and tree
decoding differ only in which keys a query may see.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
import torch.nn.functional as F
from torch import nn

import hstap.drafter.fused as fused
import hstap.drafter.integrity as integrity
from hstap.drafter.config import DrafterConfig
from hstap.drafter.vocab import draft_to_target_ids, target_to_draft_ids
from hstap.errors import HstapError

# (q, k, v) of the current step → attention output; q (B, nh, S, hd), k/v (B, nkv, S, hd)
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Matmuls:
    """The decoder layer's projections as a TTT unroll runs them, made once for all its steps
    (`Eagle3Drafter.matmuls`; hstap.train.shared makes ones whose weight gradients add up inside the matmuls):
    q, k and v as one matmul over their stacked weights, gate and up as another, then o and down. Each maps
    x (..., in) → (..., out)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm: normalised in fp32, rounded to the input dtype, then scaled by the weight (under
        autocast returned in the input dtype; one fused kernel on CUDA, `hstap.drafter.fused`)."""
        return fused.rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, S, hd); cos/sin (B, S, hd) → x·cos + rotate_half(x)·sin (one fused kernel on CUDA)."""
    return fused.rope(x, cos, sin)


class Rotary(nn.Module):
    """Llama 'default' RoPE, the same frequencies as the target's so positions mean the same thing."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # (B, S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                mm: Matmuls | None = None) -> torch.Tensor:
        """`mm`: the unroll's projections (`Matmuls`): q, k and v as one matmul instead of three."""
        b, s, _ = x.shape
        if mm is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = mm.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.reshape(b, s, self.nh, self.hd).transpose(1, 2)  # (B, nh, S, hd)
        k = k.reshape(b, s, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, S, hd)
        v = v.reshape(b, s, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, S, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v).transpose(1, 2).reshape(b, s, self.nh * self.hd)  # (B, S, nh·hd)
        return self.o_proj(out) if mm is None else mm.o(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, mm: Matmuls | None = None) -> torch.Tensor:
        """`mm`: the unroll's projections (`Matmuls`): gate and up as one matmul instead of two."""
        if mm is None:
            return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return mm.down(fused.swiglu(mm.gate_up(x)))


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn, mm: Matmuls | None = None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        hidden = hidden + self.self_attn(x, cos, sin, attend, mm)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), mm)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        n_aux = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def init_from_target(self, target_model: nn.Module, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy (and freeze) the target's embedding; install the draft vocabulary maps."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def with_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> "Eagle3Drafter":
        """A copy over a larger draft vocabulary (d2t, t2d) that holds every token of this one: all weights copied,
        each trained head row moved to its token's new draft id, and each new token's row the one a freshly built
        drafter of the new size starts from (the caller seeds torch, as it does for a fresh drafter), so the kept
        tokens' logits are unchanged and the new ones start as training from zero would start them."""
        moved = target_to_draft_ids(d2t, self.config.vocab_size)[draft_to_target_ids(self.d2t)]  # (Vd_old,)
        assert bool((moved >= 0).all()), "the new draft vocabulary must hold every token of the old one"
        grown = Eagle3Drafter(self.config.model_copy(update={"draft_vocab_size": d2t.numel()}))
        state = self.state_dict()
        head = grown.lm_head.weight.detach().clone()  # (Vd_new, H): a fresh head
        head[moved] = state["lm_head.weight"].to(head)  # the trained rows, by target id
        grown.load_state_dict({**state, "lm_head.weight": head, "d2t": d2t, "t2d": t2d})
        return grown.to(self.lm_head.weight.device, self.lm_head.weight.dtype)

    def with_mlp_width(self, width: int) -> "Eagle3Drafter":
        """A copy whose MLP has `width` ≥ its own intermediate units and computes exactly what this one does: the
        kept units keep their weights, each new unit's gate and up rows start as a fresh drafter's would (the caller
        seeds torch) and its down-projection column at zero, so it adds nothing until training moves it — and,
        since its gate and up are not zero, its down column gets a gradient from the first step."""
        have = self.config.intermediate_size
        assert width >= have, f"an MLP of {have} units cannot grow to {width}"
        grown = Eagle3Drafter(self.config.model_copy(update={"intermediate_size": width}))
        state = self.state_dict()
        fresh = grown.state_dict()
        for name in ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"):  # (I, H): rows are units
            fresh[name][:have] = state[name].to(fresh[name])
            state[name] = fresh[name]
        down = torch.zeros_like(fresh["midlayer.mlp.down_proj.weight"])  # (H, I): columns are units
        down[:, :have] = state["midlayer.mlp.down_proj.weight"].to(down)
        state["midlayer.mlp.down_proj.weight"] = down
        grown.load_state_dict(state)
        return grown.to(self.lm_head.weight.device, self.lm_head.weight.dtype)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """(B, S, n_aux*H_target) concatenated target layers → (B, S, H). Under autocast the states go in as they
        are (the matmul casts them to its dtype): bf16 states were cast up to the fp32 master weight's dtype and
        straight back down, two passes over the step's widest input."""
        device = aux.device.type
        if torch.is_autocast_enabled(device):
            return self.fc(aux)
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: AttendFn) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (token ids, previous hidden, positions) → (next hidden (B,S,H), logits (B,S,Vd))."""
        hidden = self.layer_step(input_ids, hidden, positions, attend)
        return hidden, self.lm_head(self.norm(hidden))

    def layer_step(self, input_ids: torch.Tensor | None, hidden: torch.Tensor, positions: torch.Tensor | None,
                   attend: AttendFn, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   mm: Matmuls | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`step` without the head: → next hidden (B, S, H). Training applies norm + lm_head fused with its loss.
        `rope`: the rotary (cos, sin) of `positions` (each (B or 1, S, hd)), when the caller has them already (the
        TTT unroll slices one table for all its steps); then `positions` is not read. `mm`: the projections made
        once for all of an unroll's steps (`matmuls`). `embeds`: the tokens' embeddings in `hidden`'s dtype, when
        the caller has them (the unroll looks them up once for all its steps); then `input_ids` is not read."""
        if embeds is None:
            embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = rope if rope is not None else self.rotary(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, attend, mm)

    def matmuls(self, dtype: torch.dtype) -> Matmuls:
        """The layer's projections over weights cast to `dtype` once (q/k/v and gate/up stacked,
        `stacked_weights`), their gradients flowing back to the parameters through autograd."""
        qkv, gate_up = self.stacked_weights(dtype)
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        o, down = attn.o_proj.weight.to(dtype), mlp.down_proj.weight.to(dtype)
        return Matmuls(*(functools.partial(F.linear, weight=w) for w in (qkv, gate_up, o, down)))

    def stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k, v's weights stacked (((nh + 2·nkv)·hd, 2H)) and gate, up's ((2·I, H)), in `dtype`, with their
        gradients flowing back to the parameters: the TTT unroll makes them once and runs each step's projections
        as two matmuls instead of five (fewer, larger GEMMs and a fifth of the launches; under autocast one cast
        of the stack a step instead of one per weight per use)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        # each weight cast, then the casts stacked: the same numbers as stacking the fp32 master weights and casting
        # the stack, with the concatenation moving bf16 instead of fp32 (0.7 GB less a step on the 8B shape)
        qkv = torch.cat([w.to(dtype) for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)])
        return qkv, torch.cat([w.to(dtype) for w in (mlp.gate_proj.weight, mlp.up_proj.weight)])

    # ---- persistence ---------------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embedding (it is the target's, restored by `init_from_target`)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def save_pretrained(self, out_dir: Path | str, include_embedding: bool = True, step: int | None = None) -> None:
        """config.json, model.safetensors and its checksum.json (which every load verifies: a flipped byte is
        refused, not drafted with). `step`: the training step these weights are, kept in the file's metadata (a
        resumed run tells a finished run's drafter from an earlier one's by it)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(out / "config.json")
        state = self.state_dict() if include_embedding else self.trainable_state_dict()
        tmp = out / "model.safetensors.tmp"  # renamed into place whole: a crash or a full disk leaves no torn file
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp),
                      metadata={"format": "pt", "hstap": json.dumps({"aux_layer_ids": self.config.aux_layer_ids,
                                                                     **({} if step is None else {"step": step})})})
            record = integrity.checksum_record(tmp)
            # the old checksum goes first: a crash before the new one is written leaves a drafter checked without
            # one (hstap.drafter.integrity), never new weights against an old checksum
            (out / integrity.CHECKSUM).unlink(missing_ok=True)
            os.replace(tmp, out / "model.safetensors")
            integrity.write_checksum(out, record)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def from_pretrained(cls, run_dir: Path | str, target_model: nn.Module | None = None) -> "Eagle3Drafter":
        """Load weights saved by `save_pretrained`, checked first (checksum, header, finite numbers:
        `integrity.load_weights`); without a saved embedding, `target_model` must supply it.

        Raises:
            HstapError: a damaged or non-finite model.safetensors, or tensors that are not the ones config.json
                describes, in one line naming the file.
        """
        run_dir = Path(run_dir)
        model = cls(DrafterConfig.load(run_dir / "config.json"))
        state = integrity.load_weights(run_dir)
        if "embed_tokens.weight" not in state:
            if target_model is None:
                raise HstapError(f"{run_dir}/model.safetensors has no embedding: pass the target model to restore it")
            state["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().cpu()
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # missing, unexpected or mis-shaped tensors: pages of them, one line here
            raise HstapError(f"{run_dir}/model.safetensors: not the drafter its config.json describes "
                             f"({str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else exc})"
                             ) from None
        return model
