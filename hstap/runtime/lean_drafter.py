"""A lean forward of the EAGLE-3 drafter over `KVCache`, the counterpart of `LeanLlama` for the draft model.

Same math as `Eagle3Drafter.step` / `project` (hstap/drafter/model.py, the reference the tests compare with),
from fused copies of its weights: one q/k/v matmul, one gate/up matmul, `rms_norm`, and attention through
`cache_attention`, so that a draft step is ~25 kernels and a captured chain of three steps costs a fraction of a
target forward. The drafter's cache has one layer and the target cache's columns: the step-0 entry of target
position t (hidden h_t, token t+1) lives in the same column as t's keys in the target cache.

    lean = LeanDrafter(drafter)
    hidden, logits = lean.forward(ids, lean.project(aux), positions, kv, cols, mask)     # (B, Q, H), (B, Q, Vd)

Inside a body a CUDA graph captures (`hstap.runtime.graphs.graph_body`), the forward runs through torch.compile
(`fused=True`, the default on CUDA): a graph replays whatever kernels its body launched, so fusing the step's
norms, rotary, residuals and gate cuts the launches a replay pays for (a chain:3 cycle drafts with three forwards
of ~25 kernels each, every one too small to hide its launch). Shapes are fixed inside graphs, so it compiles once
per block shape, during the capture's warm-up; a compile that fails turns it off for the drafter, with one line on
stderr, and the eager forward runs. Outside graph bodies (prefill, sampled cycles, a CPU) the forward is always
eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstap.drafter import Eagle3Drafter, draft_to_target_ids
from hstap.runtime.attention import cache_attention, group_mask, grouped_o, rope_tables, rotary_qk
from hstap.runtime.graphs import InCapture
from hstap.runtime.kv import KVCache
from hstap.runtime.linear import Projection, choose_products


class LeanDrafter:
    """The drafter's step from fused weights; `target_ids` maps draft ids to target ids. Eager on a CPU in fp32,
    the head keeps oneDNN's copy of its weight (`hstap.runtime.linear`, used where measured faster): a tree
    drafts several rows a step through it, where the reordered weight streams faster (`bench/forward_cost.py
    --reorder on off` measures it). The layer's weights stay as they are: read again at every step, they stay in
    the CPU's cache, where MKL multiplies as fast (reordering them too made a chain's drafting slower)."""

    @torch.no_grad()
    def __init__(self, drafter: Eagle3Drafter, fused: bool | None = None):
        cfg = drafter.config
        layer = drafter.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.draft_vocab = cfg.draft_vocab_size
        self.embed = drafter.embed_tokens.weight
        self.fc = drafter.fc.weight
        self.input_norm, self.hidden_norm = layer.input_layernorm.weight, layer.hidden_norm.weight
        self.post_norm, self.norm = layer.post_attention_layernorm.weight, drafter.norm.weight
        self.qkv, self.gate_up = drafter.stacked_weights(attn.q_proj.weight.dtype)  # ((nh+2nkv)·hd, 2H), (2I, H)
        self.o = grouped_o(attn.o_proj.weight, self.heads, self.kv_heads)  # cache_attention's head order
        self.down = mlp.down_proj.weight
        use = self.embed.device.type == "cuda" if fused is None else fused
        self.lm_head = Projection(drafter.lm_head.weight, reorder=False if use else None)  # compiled: F.linear
        choose_products([self.lm_head])  # the product per row count the target's projections follow too: measured
        self.inv_freq = drafter.rotary.inv_freq
        self.target_ids = draft_to_target_ids(drafter.d2t).to(self.embed.device)  # (Vd,)
        self._step = InCapture(self._forward, use, "the drafter's fused step")

    @property
    def fused(self) -> bool:
        """Whether graph bodies run the compiled step (False once compiling failed: `fused_failure` says why)."""
        return self._step.compiled is not None

    @property
    def fused_failure(self) -> str:
        return self._step.failure

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(1, batch, self.kv_heads, length, self.head_dim, self.dtype, self.embed.device)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """(B, S, n_aux·H_target) captured target layers → (B, S, H)."""
        return F.linear(aux.to(self.fc.dtype), self.fc)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                cols: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_forward`, compiled inside graph bodies when this drafter fuses."""
        return self._step(ids, hidden, positions, kv, cols, mask)

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                 cols: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: ids, positions, cols (B, Q) target ids / rotary positions / cache columns, hidden
        (B, Q, H) the previous hidden (`project`ed for step 0), mask (B, 1, Q, L) → (hidden (B, Q, H), logits
        (B, Q, Vd)). Writes the step's keys and values into `kv`."""
        b, s, _ = hidden.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        embeds = F.embedding(ids, self.embed).to(hidden.dtype)  # (B, Q, H)
        shape = hidden.shape[-1:]
        x = torch.cat([F.rms_norm(embeds, shape, self.input_norm, self.eps),
                       F.rms_norm(hidden, shape, self.hidden_norm, self.eps)], dim=-1)  # (B, Q, 2H)
        cos, sin = rope_tables(positions, self.inv_freq, 1.0, hidden.dtype)  # (B, Q, hd)
        qkv = F.linear(x, self.qkv).view(b, s, nh + 2 * nkv, hd)  # (B, Q, nh+2nkv, hd)
        rows, k = rotary_qk(qkv, nh, nkv, cos, sin)  # (B, nkv, Q·G, hd), (B, Q, nkv, hd)
        kv.write(0, kv.write_index(cols), k.transpose(1, 2), qkv[:, :, nh + nkv:].transpose(1, 2))
        span = mask.shape[-1]  # the cache prefix the mask covers
        out = cache_attention(rows, kv.keys(0)[:, :, :span], kv.values(0)[:, :, :span],
                              group_mask(mask, nh // nkv), hd ** -0.5, s)  # (B, Q, nh·hd)
        hidden = hidden + F.linear(out, self.o)
        gate, up = F.linear(F.rms_norm(hidden, shape, self.post_norm, self.eps), self.gate_up).chunk(2, dim=-1)
        hidden = hidden + F.linear(F.silu(gate) * up, self.down)
        return hidden, self.lm_head(F.rms_norm(hidden, shape, self.norm, self.eps))
