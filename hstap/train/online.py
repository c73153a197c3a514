"""Online training on the device: the target's prefill writes a TTTBatch where the drafter trains, nothing else.

    source = DeviceOnlineSource(target, samples, layer_ids=[1, 14, 26], device="cuda")
    batch = source.batch([3, 17, 42])    # TTTBatch on the device: aux (B, S, 3H) bf16, top-32 teacher, masks
    source.prefetch([5, 8])              # CUDA: the next batch's prefill overlaps the drafter step queued after it

The capture path (`OnlineSource`: the Tap's gather, pinned host copies, per-sample dicts, `collate`, then the copy
back to the device) exists to write a store; a trainer in the same process needs none of it. Here forward hooks
on the aux layers copy each layer's output straight into its slice of the batch's `aux` (in the storage dtype);
the final normed hidden state of the real tokens goes through `lm_head` a chunk of positions at a time (top-k of
the logits plus a chunked log-sum-exp, `hstap.capture.teacher`), so no full-vocabulary log-probs ever exist; the
top-k lands in the batch's teacher tensors. The result equals `collate(OnlineSource(...).fetch(indices))` up to
rounding (tested on SmolLM2): the same right-padded batch (causal, without the padding mask it does not need), the
same dtypes (teacher log-probs rounded to fp16, as a store holds them), zeros / -inf at padding. The batch plan is
the caller's (`plan_batches`), so offline and online batches agree.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from hstap.capture.hf import decoder_layers, text_decoder
from hstap.capture.hooks import first_tensor
from hstap.capture.teacher import topk_logprobs
from hstap.config import TeacherSpec, torch_dtype
from hstap.data import RenderedSample
from hstap.errors import HstapError
from hstap.train.ttt import TTTBatch

TEACHER_CHUNK_BYTES = 1 << 30  # fp32 logits of one lm_head chunk: 5,461 positions of SmolLM2's 49,152-token vocab


def pack(samples: list[RenderedSample], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Host tensors of one right-padded batch, built from flat lists (no per-sample tensor work).

    Returns ids (B, S) long padded with `pad_id` (what the target reads), valid (B, S) bool, loss_mask (B, S) bool,
    rows (T,) long: the flat index in B*S of every real token, sample after sample."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)  # (B,)
    valid = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # (B, S)
    ids = torch.full(valid.shape, pad_id, dtype=torch.long)
    ids[valid] = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)  # row-major: (T,)
    loss_mask = torch.zeros(valid.shape, dtype=torch.bool)
    loss_mask[valid] = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool)
    rows = valid.flatten().nonzero().squeeze(1)  # (T,)
    return ids, valid, loss_mask, rows


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without blocking the host on CUDA (pinned source); a no-op on the CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@contextmanager
def aux_into(model: torch.nn.Module, layer_ids: list[int], aux: torch.Tensor) -> Iterator[set[int]]:
    """Forward hooks copying decoder layer k's output (B, S, H) into `aux[..., j*H:(j+1)*H]` (j = rank of k in
    `layer_ids`), converting to aux's dtype on the way; yields the set of layers seen, removed on exit."""
    layers = decoder_layers(model)
    hidden = aux.shape[-1] // len(layer_ids)
    seen: set[int] = set()

    def hook_for(j: int, k: int):
        def hook(module, args, output) -> None:
            aux[..., j * hidden:(j + 1) * hidden].copy_(first_tensor(output))  # (B, S, H) → aux dtype
            seen.add(k)
        return hook

    handles = [layers[k].register_forward_hook(hook_for(j, k)) for j, k in enumerate(layer_ids)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def fp8_round_trip(aux: torch.Tensor, layers: int) -> None:
    """aux (B, S, n·H) in place: each layer's slice quantised as `hstap capture --dtype fp8` stores it (e4m3, one
    scale per token and layer) and read back as the trainer reads such a store. Zero (padding) rows stay zero."""
    from hstap.store.fp8 import dequantize, quantize

    hidden = aux.shape[-1] // layers
    for j in range(layers):
        part = aux[..., j * hidden:(j + 1) * hidden]
        part.copy_(dequantize(*quantize(part), dtype=aux.dtype))


def topk_teacher(states: torch.Tensor, head: torch.nn.Module, k: int, chunk: int) -> tuple[torch.Tensor, ...]:
    """Top-k log-probs of the target at each row of `states` (T, H), `chunk` rows at a time so only a chunk's
    (chunk, V) logits exist at once. Returns ids (T, k) long and log-probs (T, k) fp32 rounded through fp16 (the
    store's teacher dtype, so online and offline training see the same numbers)."""
    ids = torch.empty(states.shape[0], k, dtype=torch.long, device=states.device)
    values = torch.empty(states.shape[0], k, dtype=torch.float32, device=states.device)
    for start in range(0, states.shape[0], chunk):
        top_lp, top_ids = topk_logprobs(head(states[start:start + chunk]), k)  # (c, k) each
        ids[start:start + chunk] = top_ids
        values[start:start + chunk] = top_lp.to(torch.float16)
    return ids, values


class DeviceOnlineSource:
    """Online, device-resident: `batch(indices)` prefills the samples through the target and returns the TTTBatch
    on the target's device. Same ids, lengths and `token_masks` as `OnlineSource`, so plans and vocabularies agree."""

    def __init__(self, target, samples: list[RenderedSample], layer_ids: list[int], dtype: str = "bf16",
                 teacher: TeacherSpec | None = None, device: str = "cpu",
                 chunk_bytes: int = TEACHER_CHUNK_BYTES, as_fp8: bool = False):
        teacher = teacher or TeacherSpec()
        if teacher.kind != "topk":
            raise HstapError(f"online training computes a top-k teacher on the device, not {teacher}")
        self.target = target
        self.samples = samples
        self.ids = [s.id for s in samples]
        self.lengths = [len(s.input_ids) for s in samples]
        self.layer_ids = list(layer_ids)
        self.dtype = torch_dtype(dtype)
        self.as_fp8 = as_fp8  # each layer's states rounded as an fp8 store holds them (hstap.store.fp8)
        self.k = teacher.k
        self.device = torch.device(device)
        vocab = target.model.get_output_embeddings().weight.shape[0]
        self.chunk = max(1, chunk_bytes // (4 * vocab))  # positions per lm_head chunk
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: dict[tuple[int, ...], tuple[TTTBatch, torch.cuda.Event | None]] = {}

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.samples[index]
        return torch.tensor(s.input_ids, dtype=torch.long), torch.tensor(s.loss_mask, dtype=torch.bool)

    def batch(self, indices: list[int]) -> TTTBatch:
        """The TTTBatch of `indices` (in that order) on the device: prefetched if `prefetch` saw them, else now."""
        pending = self._pending.pop(tuple(indices), None)
        if pending is None:
            return self._prefill(indices)
        batch, ready = pending
        if ready is not None:  # made on the side stream: order after it, and keep its memory from being reused
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for name in batch.__dataclass_fields__:
                getattr(batch, name).record_stream(current)
        return batch

    def prefetch(self, indices: list[int]) -> None:
        """Queue the prefill of a batch `batch()` will ask for next. On CUDA it runs on a side stream, so it
        overlaps whatever the caller queues next on its own stream (the drafter step); elsewhere it runs now."""
        key = tuple(indices)
        if key in self._pending:
            return
        self._pending.clear()  # at most one batch ahead: one never asked for is dropped, not hoarded
        if self._stream is None:
            self._pending[key] = (self._prefill(indices), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # weights/inputs the main stream wrote
        with torch.cuda.stream(self._stream):
            batch = self._prefill(indices)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._pending[key] = (batch, ready)

    @torch.no_grad()  # not inference_mode: the batch's tensors are saved for the drafter's backward
    def _prefill(self, indices: list[int]) -> TTTBatch:
        model = self.target.model
        ids, valid, loss_mask, rows = (_to_device(t, self.device) for t in
                                       pack([self.samples[i] for i in indices], self.target.tokenizer.pad_token_id))
        b, s = ids.shape
        aux = torch.empty(b, s, len(self.layer_ids) * self.target.hidden_size, dtype=self.dtype, device=self.device)
        with aux_into(model, self.layer_ids, aux) as seen:
            # No padding mask: with right padding a causal forward never lets a real token see a pad, so the real
            # tokens' states are the masked forward's, and attention can take the fused causal kernel (flash on a
            # GPU) instead of a masked one. Pad positions are zeroed below and never reach the teacher.
            out = text_decoder(model)(input_ids=ids, attention_mask=None, use_cache=False)
        if seen != set(self.layer_ids):
            raise HstapError(f"online prefill: layers {sorted(set(self.layer_ids) - seen)} produced no output")
        aux.masked_fill_(~valid[..., None], 0)  # padding as collate leaves it
        if self.as_fp8:
            fp8_round_trip(aux, len(self.layer_ids))
        states = out.last_hidden_state.reshape(b * s, -1).index_select(0, rows)  # (T, H) real tokens only
        top_ids, top_lp = topk_teacher(states, model.get_output_embeddings(), self.k, self.chunk)  # (T, k) each
        topk_ids = torch.zeros(b * s, self.k, dtype=torch.long, device=self.device).index_copy_(0, rows, top_ids)
        topk_lp = torch.full((b * s, self.k), float("-inf"), device=self.device).index_copy_(0, rows, top_lp)
        return TTTBatch(aux=aux, input_ids=ids.masked_fill(~valid, 0), loss_mask=loss_mask, valid=valid,
                        topk_ids=topk_ids.view(b, s, self.k), topk_logprobs=topk_lp.view(b, s, self.k))
