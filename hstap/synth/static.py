"""A static KV cache and, on CUDA, a captured one-token decode step: the fast path of the embedded backend.

Plain `generate` on a GPU is launch-bound at decode (hundreds of small kernels per token for a small model), so
the decode step is captured once per (batch size, cache length) as a CUDA graph and replayed. Everything the
step reads lives in fixed buffers that the graph updates itself: the next token ids, the position ids, the
write index and the key-validity row of the attention mask. The transformers model runs unchanged; it sees a
duck-typed cache (`update(k, v, layer_idx)`) and an explicit 4D boolean mask, which transformers passes through
as-is, so nothing on the step path syncs with the host. Prefill is the model's ordinary forward (what `generate`
runs), its keys and values then copied into the static cache. For the one-query step the stepper switches the model to
`decode_attention` (registered with transformers' AttentionInterface): grouped-query attention over the cache
without materialising the repeated key/value heads that `sdpa` with a mask needs, which dominated the step.

    from hstap.synth.static import StaticStepper
    stepper = StaticStepper(model, batch_size=64, max_len=4096, pad_id=2, cuda_graphs=True)
    decode(stepper, requests, ...)      # hstap.synth.embedded.decode

On a CPU it runs the same code without a graph (tests compare it with the eager loop there).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

LEN_BUCKET = 256  # cache lengths are rounded up to this: one graph serves every batch that fits
DECODE_ATTENTION = "hstap_static_decode"


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Attention of one new token per row over a static cache; transformers' attention-function signature.

    query [B, H, 1, D], key/value [B, H_kv, L, D], attention_mask [B, 1, 1, L] bool -> ([B, 1, H, D], None).
    The H / H_kv query heads that share a kv head are stacked as rows of one matmul against it.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    assert q_len == 1, "decode_attention serves the one-token decode step only"
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, H_kv, G, D], head h = kv * G + g
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, H_kv, G, L]
    scores = scores.masked_fill(~attention_mask, float("-inf"))  # mask [B, 1, 1, L] broadcasts
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # [B, H_kv, G, D]
    return out.reshape(batch, 1, heads, dim), None


def _register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both [B, P]: each prompt right-aligned so that every row's next token is at column P."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, P] 0/1 mask -> [B, P] position ids counting real tokens only (padding gets 0, as `generate` does)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


class StaticKV:
    """One preallocated `[B, H_kv, L, D]` key and value buffer per layer; `update` writes at `self.index`.

    transformers' attention layers call `update(key_states, value_states, layer_idx)` and attend over what it
    returns: the whole buffer, with the 4D mask hiding the slots not written yet.
    """

    def __init__(self, config, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # where `update` writes: the slot's write_at

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H_kv, q, D] written at the q positions in self.index
        self.keys[layer_idx].index_copy_(2, self.index, key_states)
        self.values[layer_idx].index_copy_(2, self.index, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


class _Slot:
    """Buffers (and the graph) for one cache length: everything a replayed step reads or writes."""

    def __init__(self, model, batch: int, length: int, pad_id: int):
        p = next(model.parameters())
        self.length = length
        self.cache = StaticKV(model.config, batch, length, p.dtype, p.device)
        self.tokens = torch.full((batch, 1), pad_id, dtype=torch.long, device=p.device)  # [Bg, 1]
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=p.device)  # [Bg, 1]
        self.write_at = torch.zeros(1, dtype=torch.long, device=p.device)  # [1], same column for every row
        self.cache.index = self.write_at
        self.valid = torch.zeros((batch, length), dtype=torch.bool, device=p.device)  # [Bg, L] keys to attend
        self.logits = torch.zeros((batch, model.config.vocab_size), dtype=torch.float32, device=p.device)
        self.graph: torch.cuda.CUDAGraph | None = None


class StaticStepper:
    """Decode with a fixed batch size over static caches; `cuda_graphs=True` replays a captured step.

    Prefill is transformers' ordinary forward; only the one-token steps use the static cache. Batches smaller than
    `batch_size` step with dummy rows (a graph has one shape); up to `max_slots` cache lengths are kept, least
    recently used evicted.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int, pad_id: int,
                 cuda_graphs: bool = True, max_slots: int = 3, compile_step: bool = False):
        self.model, self.batch_size, self.max_len, self.pad_id = model, batch_size, max_len, pad_id
        # torch.compile fuses the step's many small kernels (norms, rotary, residuals); the graph then replays those
        self._step_forward = torch.compile(model, dynamic=False) if compile_step else model
        self.cuda_graphs, self.max_slots = cuda_graphs, max_slots
        _register_decode_attention()
        self.slots: OrderedDict[int, _Slot] = OrderedDict()
        self.slot: _Slot | None = None
        self.rows = 0

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Run the prompt exactly as `generate` does (2D mask, DynamicCache), then copy its keys and values into
        the static cache: the first token is generate's, and prefill hooks see an ordinary padded batch."""
        from transformers import DynamicCache


        rows, width = ids.shape  # [B, P]
        if rows > self.batch_size:
            raise ValueError(f"batch of {rows} rows exceeds the stepper's batch_size {self.batch_size}")
        if width + max_new_tokens > self.max_len:
            raise ValueError(f"{width} prompt + {max_new_tokens} new tokens exceed max_len {self.max_len}")
        length = min(self.max_len, -(-(width + max_new_tokens) // LEN_BUCKET) * LEN_BUCKET)
        slot = self.slot = self._get_slot(length)
        self.rows = rows
        positions = positions_from_mask(mask)  # [B, P]
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        assert len(cache.layers) == len(slot.cache.keys), "one cache layer per decoder layer"
        for layer, kv in enumerate(cache.layers):  # keys/values [B, H_kv, P, D]
            slot.cache.keys[layer][:rows, :, :width].copy_(kv.keys)
            slot.cache.values[layer][:rows, :, :width].copy_(kv.values)
        # rows past `rows` are dummies (a graph has one batch size): nothing valid but the token they step on
        slot.valid.zero_()
        slot.valid[:rows, :width] = mask.bool()
        slot.positions.zero_()
        slot.positions[:rows].copy_(positions[:, -1:] + 1)
        slot.write_at.fill_(width)
        slot.tokens.fill_(self.pad_id)
        return out.logits[:, -1].float()  # [B, V]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> logits [B, V]: a view of a buffer the next step overwrites (read it before then)."""
        slot = self.slot
        assert slot is not None, "prefill must run before step"
        slot.tokens[:self.rows, 0].copy_(tokens)
        if slot.graph is not None:
            slot.graph.replay()
        else:
            self._step_body(slot)
        return slot.logits[:self.rows]

    def _step_body(self, slot: _Slot) -> None:
        """One decode step that only touches slot buffers: safe to capture as a CUDA graph and replay."""
        slot.valid.index_fill_(1, slot.write_at, True)  # the new token sees itself
        config = self.model.config
        saved, config._attn_implementation = config._attn_implementation, DECODE_ATTENTION
        try:  # the graph records the kernels chosen here; prefill keeps the model's own attention
            out = self._step_forward(input_ids=slot.tokens, attention_mask=slot.valid[:, None, None, :],
                                     position_ids=slot.positions, past_key_values=slot.cache, use_cache=True,
                                     logits_to_keep=1)
        finally:
            config._attn_implementation = saved
        slot.logits.copy_(out.logits[:, -1])
        slot.positions.add_(1)
        slot.write_at.add_(1)

    def _get_slot(self, length: int) -> _Slot:
        if length in self.slots:
            self.slots.move_to_end(length)
            return self.slots[length]
        while len(self.slots) >= self.max_slots:
            self.slots.popitem(last=False)
        slot = _Slot(self.model, self.batch_size, length, self.pad_id)
        if self.cuda_graphs:
            self._capture(slot)
        self.slots[length] = slot
        return slot

    def _capture(self, slot: _Slot) -> None:
        """Warm up on a side stream (lazy inits, cuBLAS workspaces), then capture one step.

        Warm-up really runs the step and so advances the slot's state; prefill resets all of it.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # a compiled step compiles on the first call
                self._step_body(slot)
        torch.cuda.current_stream().wait_stream(stream)
        slot.write_at.zero_()
        slot.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(slot.graph):
            self._step_body(slot)
