"""The target on static caches: a batched prefill, then one-token steps replayed from a CUDA graph.

Prefill is `LeanLlama.forward` over the left-padded prompts (`prefill="lean"`, the default): one forward per row
chunk, its keys and values written in place into columns [0, P) of the slot's rows, attention causal and blind to
padding keys, the drafter's aux states returned by the forward itself, the lm_head on the last position only.
transformers' forward used to do it (eager, ~50 kernels a layer, a DynamicCache copied into the cache after),
which on a GPU cost a visible share of the speculative speedup. It equals transformers' prefill (fp32: logits, cache
rows and aux to rounding; tests/runtime/test_prefill.py). `prefill="model"` keeps transformers' forward, for
callers whose hooks on the model must see the prompts as an ordinary padded batch (the `hf` engine's capture
taps). With graphs (CUDA, or `rehearse`) a whole-batch lean prefill is replayed from a CUDA graph too: eagerly it
is ~600 kernel launches for a small fraction of their time in arithmetic. Its batch is left-padded
further to a width bucket W (P rounded up to PREFILL_BUCKET) and all slot rows run, one graph per (W, aux layers)
in the slot; extra padding changes nothing real (positions count real tokens, padding keys are masked), so the
caller sees the logits and its P aux columns as before, with start = W − length and write_at = W. It stays eager
where the bucket would need a bigger slot than the prompt's (a new cache drops every graph), where rows × W passes
GRAPH_PREFILL_TOKENS (synth's 256 long rows), for `admit` (continuous batching) and for `prefill="model"`. A
caller laying out columns itself pads to `prefill_width` first (SpecDecoder). Every later forward — a decode
step, a verification block — is `LeanLlama.forward` over that cache, captured once per (slot, shape) on CUDA.
Slots are caches of one length bucket (LRU, `max_slots`); a graph has one batch size, so a smaller batch steps
with dummy rows that see nothing but themselves.

    rt = Runtime(model, batch_size=8, max_len=4096)                # graphs on CUDA, eager on a CPU; prefill="model"
                                                                   # for transformers' forward (hooks see it)
    logits = rt.prefill(ids, mask, max_new_tokens=256)             # (B, V) fp32, next token of every row
    logits = rt.step(tokens)                                       # tokens (B,) → (B, V), a reused buffer
"""

from __future__ import annotations

import gc

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from hstap.runtime.graphs import Graphed
from hstap.runtime.kv import KVCache, block_columns, block_mask
from hstap.runtime.llama import LeanLlama

LEN_BUCKET = 256  # cache lengths are rounded up to this: one set of graphs serves every batch that fits
KV_BUDGET = 0.4  # on CUDA the slots' caches together may take at most this share of the device's memory
PREFILL_TOKENS = 1 << 16  # rows x width of one prefill forward; wider batches are prefilled in row chunks
PREFILL_SCORES = 1 << 31  # rows x heads x width^2 attention scores of one prefill forward (the masked kernel's)
PREFILL_PATHS = ("lean", "model")  # Runtime(prefill=...): LeanLlama's forward, or the transformers model's
PREFILL_BUCKET = 64  # with graphs, a whole-batch prefill is left-padded to a multiple of this: one graph per bucket
GRAPH_PREFILL_TOKENS = 8192  # batch x bucket width of a graph-replayed prefill; past it (synth's) it runs eagerly


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, P] 0/1 mask -> [B, P] position ids counting real tokens only (padding gets 0, as `generate` does)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


class Slot:
    """Everything the graphs of one cache length read and write; rows past `rows` are dummies."""

    def __init__(self, lean: LeanLlama, batch: int, length: int):
        device = lean.embed.device
        self.length, self.batch, self.rows = length, batch, batch
        self.kv: KVCache = lean.new_cache(batch, length)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) first real column
        self.write_at = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) next column to write
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1) decode-step input
        self.logits = torch.zeros(batch, lean.vocab_size, dtype=torch.float32, device=device)  # (B, V) output
        self.graphs: dict[object, Graphed] = {}
        # the slot's graphs share one memory pool, the slot's own: once an evicted slot's graphs are gone its pool
        # may linger (use count 0) while a tensor made in a capture lives on, and the CUDA allocator refuses a new
        # capture into such a pool (an internal assert; seen on a GPU when continuous synth replaced its slots)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.buffers: dict[object, object] = {}  # per speculative method: its own static buffers
        self.bound = 0  # host-side upper bound of every row's write_at
        self.eager = True  # no graphs: forwards may attend to a prefix of the cache
        self.graph_width: int | None = None  # the last prefill's width when it replayed a graph (a bucket), else None

    def span(self, extra: int) -> int:
        """Columns a forward writing up to `extra` entries past write_at must attend to: on the eager path only
        the used prefix (a CPU skips the empty columns), with graphs the whole buffer (one shape)."""
        return min(self.length, self.bound + extra) if self.eager else self.length

    @property
    def positions(self) -> torch.Tensor:
        """(B,) position of the next token of each row (real tokens before it)."""
        return self.write_at - self.start


def prefill_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[k, P] 0/1 padding mask → the additive (k, 1, P, P) mask of a prefill: a block written at column 0 with
    no prefix (`block_mask`), whose query j sees key j' ≤ j when j' is a real token, and always itself (a
    padding query then attends to its own column instead of to nothing)."""
    rows, width = mask.shape
    device = mask.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (P, P)
    tree = (causal & mask.bool()[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)  # (k, P, P)
    column0 = torch.zeros(rows, dtype=torch.long, device=device)
    return block_mask(column0, column0, width, tree, dtype)


def pad_left(ids: torch.Tensor, mask: torch.Tensor, width: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids/mask [B, P] → [B, width ≥ P], more padding in front: positions count real tokens only and
    the prefill mask hides padding keys, so every real token's logits, keys, values and aux stay what they were."""
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (torch.cat([ids.new_full((ids.shape[0], extra), pad_id), ids], dim=1),
            torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1))


@dataclass
class PrefillBuffers:
    """A slot's static buffers of graph-replayed prefills, views [:, :W] per bucket width W (so their memory is
    one widest bucket's, not a sum over buckets): the inputs, and the outputs the caller gets copies of."""

    ids: torch.Tensor  # (B, Wmax) long
    mask: torch.Tensor  # (B, Wmax) long 0/1, dummy rows all 0
    logits: torch.Tensor  # (B, V) fp32, the last position's
    aux: dict[tuple[int, ...], torch.Tensor]  # aux layers → (B, Wmax, n·H) in the model dtype


def consecutive_runs(rows: list[int]) -> list[tuple[int, int]]:
    """Ranges [a, b) of `rows` over which the slot rows count up by one, e.g. [4, 5, 6, 0, 1] → [(0, 3), (3, 5)]:
    each is one slice of the slot's cache, which a lean prefill writes in place."""
    runs, first = [], 0
    for b in range(1, len(rows) + 1):
        if b == len(rows) or rows[b] != rows[b - 1] + 1:
            runs.append((first, b))
            first = b
    return runs


def prefill_chunks(rows: int, width: int, heads: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) whose prefill stays within PREFILL_TOKENS tokens and PREFILL_SCORES attention scores;
    e.g. 256 rows of 4096 tokens → 16-row chunks. At least one row per chunk."""
    per = max(1, min(PREFILL_TOKENS // max(width, 1), PREFILL_SCORES // max(heads * width * width, 1)))
    return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


class Runtime:
    """Prefill + static-cache forwards of one target, for up to `batch_size` rows.

    `cuda_graphs` (default: on CUDA) replays captured steps; `compile_step` also runs the forward through
    torch.compile (faster kernels, a compile per shape). `rehearse` (tests, any device): do everything the graph
    path does — capture warm-ups with their state restore, full-width attention — except capturing.
    `prefill`: "lean" (default) runs the prompts through `LeanLlama.forward`, written in place into the cache;
    "model" runs them through the transformers model, for callers whose hooks on it must see the prefill (the
    `hf` engine's capture taps); both give the same logits, cache rows and aux states (fp32: to rounding).
    `prefill_bucket`: with graphs, a whole-batch lean prefill is padded to a multiple of it and replayed from one
    graph per width (`prefill_width`); 0 keeps every prefill eager. `mlp_form`: `LeanLlama`'s (None: the one
    measured faster on the model's device); `kv_write`: its cache's write form (`kv.KVCache`); `reorder`: its
    projections' oneDNN copies (`hstap.runtime.linear`; None: on a CPU in fp32, never with `compile_step`)."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int, cuda_graphs: bool | None = None,
                 len_bucket: int = LEN_BUCKET, max_slots: int = 3, compile_step: bool = False,
                 rehearse: bool = False, prefill: str = "lean", prefill_bucket: int = PREFILL_BUCKET,
                 mlp_form: str | None = None, kv_write: str = "scatter", reorder: bool | None = None):
        if prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_PATHS)}, got {prefill!r}")
        self.prefill_path, self.prefill_bucket = prefill, prefill_bucket
        self.model, self.batch_size, self.max_len = model, batch_size, max_len
        self.lean = LeanLlama(model, mlp_form, kv_write, False if compile_step else reorder)
        self.device = self.lean.embed.device
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.cuda_graphs = self.cuda_graphs and self.device.type == "cuda"
        # static shapes: one compile per cache length. Automatic dynamic shapes (dynamic=None) ran the step several
        # times slower than the uncompiled graph when tried on a GPU (docs/benchmarks.md)
        self.forward = torch.compile(self.lean.forward, dynamic=False) if compile_step else self.lean.forward
        self.len_bucket, self.max_slots, self.rehearse = len_bucket, max_slots, rehearse
        self.slots: OrderedDict[int, Slot] = OrderedDict()
        self.slot: Slot | None = None
        self.decoders: dict[str, int] = {}  # speculative decoders per draft shape (their graphs are per decoder)

    # ---- prefill ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, reserve: int = 0,
                aux_layers: list[int] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run left-padded prompts ids/mask [B, P]; → next-token logits (B, V) fp32, plus the prompts' residual
        streams after `aux_layers` (B, P, n·H) when asked. `reserve`: extra columns past the answer (draft
        blocks are written beyond the committed tokens)."""
        rows, width = ids.shape
        if rows > self.batch_size:
            raise ValueError(f"batch of {rows} rows exceeds the runtime's batch_size {self.batch_size}")
        # the caller sized the runtime for its prompts (the Engine refuses a request over the positions at submit)
        assert width + max_new_tokens <= self.max_len, f"{width} prompt + {max_new_tokens} new > max_len {self.max_len}"
        bucket = self.graph_bucket(width, max_new_tokens, reserve)
        ids, mask = pad_left(ids, mask, bucket or width)
        padded = ids.shape[1]
        slot = self._fresh_slot(padded + max_new_tokens + reserve)  # the same slot as for `width` (graph_bucket)
        slot.rows = rows
        slot.write_at.fill_(padded)
        slot.start.fill_(padded)  # dummy rows: nothing to attend to but themselves
        if bucket:
            logits, aux = self._prefill_graph(slot, ids, mask, tuple(aux_layers))
        else:
            logits, aux = self._prefill_rows(slot, list(range(rows)), ids, mask, aux_layers)
        slot.bound, slot.graph_width = padded, bucket
        return logits if not aux_layers else (logits, aux[:, padded - width:])  # the caller's P columns

    def prefill_width(self, width: int, max_new_tokens: int, reserve: int = 0) -> int:
        """The width `prefill` runs a [B, width] batch at: the graph bucket when it replays one, else `width`.
        A caller that lays out columns itself (SpecDecoder's token history, the drafter's step-0 entries) pads
        its prompts to this first, so that its columns agree with the cache's (write_at = this width)."""
        return self.graph_bucket(width, max_new_tokens, reserve) or width

    def graph_bucket(self, width: int, max_new_tokens: int, reserve: int = 0) -> int | None:
        """The bucket width W ≥ width of a graph-replayed prefill, or None (eager): graphs on, the lean path, B·W
        within GRAPH_PREFILL_TOKENS and one row chunk, and W plus the answer within max_len and the slot that
        `width` gets anyway — a bigger slot would be a new cache and throw away every graph captured on this one
        (the evaluation's Methods keeps one slot of a fixed length)."""
        step = self.prefill_bucket
        if step <= 0 or not (self.cuda_graphs or self.rehearse) or self.prefill_path != "lean":
            return None
        bucket = -(-width // step) * step
        length = self._slot_length(width + max_new_tokens + reserve)
        fits = bucket + max_new_tokens + reserve <= length and bucket + max_new_tokens <= self.max_len
        small = self.batch_size * bucket <= GRAPH_PREFILL_TOKENS and \
            len(prefill_chunks(self.batch_size, bucket, self.lean.heads)) == 1
        return bucket if fits and small else None

    def open_slot(self, length: int) -> Slot:
        """An empty slot of at least `length` columns, every row idle (nothing to attend to), for continuous
        batching: rows are then filled one request at a time by `admit` while the others keep stepping."""
        slot = self._fresh_slot(length)
        slot.rows = slot.batch
        slot.start.zero_()
        slot.write_at.zero_()
        slot.bound = 0
        return slot

    @torch.inference_mode()
    def admit(self, rows: list[int], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Prefill left-padded prompts ids/mask [k, P] into `rows` of the current slot; the other rows keep their
        caches and positions. → next-token logits (k, V) fp32 of the admitted rows."""
        slot = self.slot
        if slot is None or ids.shape[1] > slot.length:
            raise ValueError(f"a {ids.shape[1]}-token prompt does not fit the open slot "
                             f"({slot.length if slot else 0} columns)")
        width = ids.shape[1]
        slot.write_at[torch.tensor(rows, dtype=torch.long, device=ids.device)] = width
        logits = self._prefill_rows(slot, list(rows), ids, mask, ())[0]
        slot.bound = max(slot.bound, width)  # the eager path attends to columns [0, bound + block)
        return logits

    def _slot_length(self, need: int) -> int:
        return -(-need // self.len_bucket) * self.len_bucket

    def _fresh_slot(self, need: int) -> Slot:
        self.slot = None  # an evicted slot's cache must be free before the next one is allocated
        slot = self.slot = self._get_slot(self._slot_length(need))
        slot.eager = not (self.cuda_graphs or self.rehearse)
        return slot

    def _prefill_rows(self, slot: Slot, rows: list[int], ids: torch.Tensor, mask: torch.Tensor,
                      aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill ids/mask [k, P] into columns [0, P) of the slot's rows `rows` (k of them), their start set from
        the padding; → logits (k, V) fp32, aux (k, P, n·H) | None. Row chunks bound activations and scores."""
        if len(rows) != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} prompts for {len(rows)} rows")
        run = self._prefill_lean if self.prefill_path == "lean" else self._prefill_model
        logits, aux = run(slot, rows, ids, mask, aux_layers)
        slot.start[torch.tensor(rows, dtype=torch.long, device=ids.device)] = ids.shape[1] - mask.sum(-1)
        return torch.cat(logits), (torch.cat(aux) if aux_layers else None)

    def _prefill_lean(self, slot: Slot, rows: list[int], ids: torch.Tensor, mask: torch.Tensor,
                      aux_layers: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`LeanLlama.forward` over each chunk of consecutive slot rows, a view of their cache rows as its cache:
        keys and values land in place (no DynamicCache, no copy), the aux states come out of the forward (no
        hooks), the lm_head runs on the last position only. Eager even with `compile_step`: one compile per
        prompt width would cost more than it saves."""
        width = ids.shape[1]
        logits, aux = [], []
        for first, end in consecutive_runs(rows):
            for r0, r1 in prefill_chunks(end - first, width, self.lean.heads):
                r0, r1 = first + r0, first + r1
                kv = slot.kv.rows(rows[r0], rows[r0] + r1 - r0)
                cols = block_columns(torch.zeros(r1 - r0, dtype=torch.long, device=ids.device), width, slot.length)
                out, states = self.lean.forward(ids[r0:r1], positions_from_mask(mask[r0:r1]), kv, cols,
                                                prefill_mask(mask[r0:r1], self.lean.dtype), aux_layers,
                                                last_only=True)
                logits.append(out[:, -1].float())  # (rows, V)
                aux.append(states)  # (rows, P, n·H) | None
        return logits, aux

    def _prefill_graph(self, slot: Slot, ids: torch.Tensor, mask: torch.Tensor, aux_layers: tuple[int, ...],
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lean prefill of all slot.batch rows at the bucket width W of ids/mask [k, W], replayed from the
        slot's graph ("prefill", W, aux_layers): ~600 kernel launches of an eager forward become one replay. Rows
        past k are dummies (padding only, seeing themselves; their start stays W). → logits (k, V) fp32, aux
        (k, W, n·H) | None: copies, as the eager path returns, not views of buffers the next prefill overwrites."""
        rows, width = ids.shape
        buf = self._prefill_buffers(slot, aux_layers)
        buf.ids[:, :width].zero_()
        buf.ids[:rows, :width].copy_(ids)
        buf.mask[:, :width].zero_()
        buf.mask[:rows, :width].copy_(mask)
        self.graph(("prefill", width, aux_layers), lambda: self._prefill_body(slot, buf, width, aux_layers), [])()
        slot.start[:rows] = width - mask.sum(-1)
        aux = buf.aux[aux_layers][:rows, :width].clone() if aux_layers else None
        return buf.logits[:rows].clone(), aux

    def _prefill_buffers(self, slot: Slot, aux_layers: tuple[int, ...]) -> PrefillBuffers:
        """The slot's prefill buffers, as wide as its widest possible bucket; an aux buffer per set of layers."""
        if "prefill" not in slot.buffers:
            cap = min(slot.length, GRAPH_PREFILL_TOKENS // slot.batch)
            long = dict(dtype=torch.long, device=self.device)
            slot.buffers["prefill"] = PrefillBuffers(
                torch.zeros(slot.batch, cap, **long), torch.zeros(slot.batch, cap, **long),
                torch.zeros(slot.batch, self.lean.vocab_size, dtype=torch.float32, device=self.device), {})
        buf = slot.buffers["prefill"]
        if aux_layers and aux_layers not in buf.aux:
            hidden = self.lean.layers[0].ln1.shape[0]
            buf.aux[aux_layers] = torch.zeros(slot.batch, buf.ids.shape[1], len(aux_layers) * hidden,
                                              dtype=self.lean.dtype, device=self.device)
        return buf

    def _prefill_body(self, slot: Slot, buf: PrefillBuffers, width: int, aux_layers: tuple[int, ...]) -> None:
        """The prefill graph's body: every tensor it reads or writes besides the cache is a view of `buf`; the
        positions, the mask and the columns are computed inside it (in the slot's pool, not kept per bucket)."""
        ids, mask = buf.ids[:, :width], buf.mask[:, :width]
        cols = block_columns(torch.zeros(slot.batch, dtype=torch.long, device=self.device), width, slot.length)
        out, states = self.lean.forward(ids, positions_from_mask(mask), slot.kv, cols,
                                        prefill_mask(mask, self.lean.dtype), list(aux_layers), last_only=True)
        buf.logits.copy_(out[:, -1])
        if aux_layers:
            buf.aux[aux_layers][:, :width].copy_(states)

    def _prefill_model(self, slot: Slot, rows: list[int], ids: torch.Tensor, mask: torch.Tensor,
                       aux_layers: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """transformers' forward in row chunks (hooks on the model see an ordinary padded batch), its keys and
        values then copied into the slot's rows, the aux states read by forward hooks."""
        from transformers import DynamicCache

        width = ids.shape[1]
        index = torch.tensor(rows, dtype=torch.long, device=ids.device)  # (k,)
        logits, aux = [], []
        for r0, r1 in prefill_chunks(len(rows), width, self.lean.heads):  # bounded activations and attention scores
            cache = DynamicCache(config=self.model.config)
            with self._taps(aux_layers) as seen:
                out = self.model(input_ids=ids[r0:r1], attention_mask=mask[r0:r1],
                                 position_ids=positions_from_mask(mask[r0:r1]), past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
            for layer, entry in enumerate(cache.layers):  # keys/values (rows, H_kv, P, D)
                slot.kv.load_rows(layer, entry.keys, entry.values, index[r0:r1], width)
            logits.append(out.logits[:, -1].float())  # (rows, V)
            if aux_layers:
                aux.append(torch.cat([seen[k] for k in aux_layers], dim=-1))  # (rows, P, n·H)
            del cache, out
        return logits, aux

    @contextmanager
    def _taps(self, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
        """Forward hooks keeping the residual stream after decoder layer k (hstap layer k) during prefill."""
        seen: dict[int, torch.Tensor] = {}
        layers = self.model.model.layers

        def keep(k: int):
            def hook(module, args, output) -> None:
                seen[k] = output[0] if isinstance(output, tuple) else output  # (B, P, H)
            return hook

        handles = [layers[k].register_forward_hook(keep(k)) for k in sorted(set(layer_ids))]
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    def _get_slot(self, length: int) -> Slot:
        """The slot of this cache length; older slots are dropped (least recently used first) past `max_slots`, and
        on CUDA past KV_BUDGET of the device's memory: a batch of 256 long conversations needs one 8k-column cache of
        ~50 GB, and three such slots would not fit beside the prefill."""
        if length in self.slots:
            self.slots.move_to_end(length)
            return self.slots[length]
        budget = KV_BUDGET * torch.cuda.get_device_properties(self.device).total_memory \
            if self.device.type == "cuda" else float("inf")
        need = self.lean.cache_bytes(self.batch_size, length)
        evicted = False
        while self.slots and (len(self.slots) >= self.max_slots or
                              need + sum(s.kv.data.nbytes for s in self.slots.values()) > budget):
            self.slots.popitem(last=False)
            evicted = True
        if evicted:
            gc.collect()  # a slot's graphs refer back to it: only the collector frees that cycle (and its cache)
        slot = self.slots[length] = Slot(self.lean, self.batch_size, length)
        return slot

    # ---- graphs -------------------------------------------------------------------------------------------

    def graph(self, key: object, body: Callable[[], None], state: list[torch.Tensor]) -> Graphed:
        """The current slot's graph `key` (captured at first use, with `state` saved and restored)."""
        slot = self.slot
        if key not in slot.graphs:
            slot.graphs[key] = Graphed(body, self.cuda_graphs, slot.pool, state, rehearse=self.rehearse)
        return slot.graphs[key]

    def block(self, slot: Slot, tokens: torch.Tensor, depths: torch.Tensor, tree: torch.Tensor,
              aux_layers: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward of a (B, Q) block at each row's write position: depths (B, Q) or (Q,) add to the row's next
        position, tree (B, Q, Q) or (Q, Q) says which block entries each query sees. Writes the block's keys
        and values into the cache; → (logits (B, Q, V), aux (B, Q, n·H) | None). Capturable."""
        q = tokens.shape[1]
        cols = block_columns(slot.write_at, q, slot.length)  # (B, Q)
        positions = slot.positions[:, None] + depths  # (B, Q)
        mask = block_mask(slot.start, slot.write_at, slot.span(q), tree, self.lean.dtype)  # (B, 1, Q, S)
        return self.forward(tokens, positions, slot.kv, cols, mask, aux_layers)

    # ---- one-token decode ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows,) → next-token logits (rows, V) fp32: a view of a buffer the next step overwrites."""
        slot = self.slot
        assert slot is not None, "prefill must run before step"
        slot.tokens[: slot.rows, 0].copy_(tokens)
        self.graph("step", lambda: self._step_body(slot), [slot.write_at])()
        slot.bound += 1
        return slot.logits[: slot.rows]

    def _step_body(self, slot: Slot) -> None:
        one = torch.ones(1, 1, dtype=torch.bool, device=self.device)  # the token sees itself
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        logits, _ = self.block(slot, slot.tokens, zero, one)
        slot.logits.copy_(logits[:, -1])
        slot.write_at.add_(1)
