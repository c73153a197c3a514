"""Where training samples come from — a store on disk (offline) or the target in this process (online) — and the
length-bucketed batch plan both share, so the same seed gives the same batches either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch

from hstap.capture.teacher import topk_logprobs
from hstap.config import TeacherSpec
from hstap.data import RenderedSample
from hstap.errors import HstapError
from hstap.store.fp8 import dequantize_aux
from hstap.store.manifest import torch_dtype
from hstap.store.names import SCALE_PREFIX, hidden_name, scale_name
from hstap.train.ttt import TTTBatch, collate, empty_batch


class SampleSource(Protocol):
    """Samples in store format (see hstap.store): id, input_ids, loss_mask, hidden {layer: [S,H]}, teacher."""

    ids: list[str]
    lengths: list[int]

    def fetch(self, indices: list[int]) -> list[dict]: ...

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class BatchSource(Protocol):
    """A source that builds whole TTTBatches on the training device itself (hstap.train.online): no host samples."""

    ids: list[str]
    lengths: list[int]

    def batch(self, indices: list[int]) -> TTTBatch: ...

    def prefetch(self, indices: list[int]) -> None: ...

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def load_batch(source: SampleSource | BatchSource | StoreSource, indices: list[int], layer_ids: list[int],
               device: torch.device) -> TTTBatch:
    """The batch of `indices` on `device`: a BatchSource makes it there, a store's is read and collated on the host
    (ahead, where `prefetch` asked) and copied; other host samples are collated, then copied."""
    if isinstance(source, BatchSource):
        return source.batch(indices)
    if isinstance(source, StoreSource):
        return source.load(indices, layer_ids, device)
    return fill_host(source.fetch(indices), layer_ids).to(device, None)


HIDDEN_TEACHER_K = 32  # top-k a `hidden` teacher becomes: what `hstap capture` stores by default
TEACHER_LOGITS_BYTES = 256 << 20  # a hidden teacher's logits are made this many bytes of rows at a time


@torch.no_grad()
def topk_teacher_batch(hidden: torch.Tensor, valid: torch.Tensor, lm_head: torch.nn.Module,
                       k: int = HIDDEN_TEACHER_K) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's `hidden` teacher (B, S, H), on lm_head's device → topk ids (B, S, k) long and log-probs (B, S, k)
    fp32, rounded through fp16 as a top-k store holds them; padding gets id 0 and -inf, as `collate` pads. Every
    position is computed, padding too: selecting the valid rows first would read the mask back to the host."""
    weight = lm_head.weight
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B·S, H)
    rows = max(1, TEACHER_LOGITS_BYTES // (weight.shape[0] * weight.element_size()))
    parts = [topk_logprobs(lm_head(flat[i:i + rows].to(weight.dtype)), k) for i in range(0, len(flat), rows)]
    values = torch.cat([v for v, _ in parts]).view(*hidden.shape[:2], k)
    ids = torch.cat([i for _, i in parts]).view(*hidden.shape[:2], k)
    pad = ~valid[..., None]
    return ids.masked_fill(pad, 0), values.half().float().masked_fill(pad, -float("inf"))


@dataclasses.dataclass
class HostBatch:
    """A store's batch collated on the host (pinned for a CUDA device), before its copy."""

    batch: TTTBatch  # its teacher fields (B, S, 0) when `teacher_hidden` holds the teacher
    scales: torch.Tensor | None  # an fp8 store's scales (B, S, n layers)
    teacher_hidden: torch.Tensor | None  # a `hidden`-teacher store's final normed states (B, S, H)

    def to(self, device: torch.device, lm_head: torch.nn.Module | None,
           copy_stream: torch.cuda.Stream | None = None) -> TTTBatch:
        """The TTTBatch on `device`: copied (asynchronously from pinned memory), fp8 dequantised there, a hidden
        teacher turned into top-k by `lm_head` where it lives (the trainer puts it on the device).

        `copy_stream`: copy on that side stream, so the copy overlaps what the current stream still computes (the
        step before); the current stream waits for it on the device, never the host."""
        if copy_stream is None:
            batch, scales, teacher_hidden = self._copied(device, lm_head)
        else:
            current = torch.cuda.current_stream(device)
            with torch.cuda.stream(copy_stream):
                batch, scales, teacher_hidden = self._copied(device, lm_head)
                ready = torch.cuda.Event()
                ready.record(copy_stream)
            current.wait_event(ready)
            for t in (*(getattr(batch, f) for f in TTTBatch.__dataclass_fields__), scales, teacher_hidden):
                if t is not None and t.is_cuda:  # made on the side stream, used on this one: kept till it is done
                    t.record_stream(current)
        if scales is not None:
            batch = dataclasses.replace(batch, aux=dequantize_aux(batch.aux, scales))
        if teacher_hidden is not None:
            if lm_head is None:
                raise HstapError("store has a `hidden` teacher: the target's lm_head is needed (pass --model)")
            ids, logprobs = topk_teacher_batch(teacher_hidden, batch.valid.to(teacher_hidden.device), lm_head)
            batch = dataclasses.replace(batch, topk_ids=ids.to(device), topk_logprobs=logprobs.to(device))
        return batch

    def _copied(self, device: torch.device, lm_head: torch.nn.Module | None):
        """The batch, the fp8 scales and the hidden teacher copied (the teacher to lm_head's device)."""
        scales = self.scales.to(device, non_blocking=True) if self.scales is not None else None
        teacher_hidden = None
        if self.teacher_hidden is not None:
            where = lm_head.weight.device if lm_head is not None else device
            teacher_hidden = self.teacher_hidden.to(where, non_blocking=True)
        return self.batch.to(device), scales, teacher_hidden


class StoreSource:
    """Offline: samples read lazily from a capture store. `prefetch(indices)` reads and collates a batch on a host
    thread while the device trains on the one before it: for an 8B target a 2,048-token batch is ~50 MB of
    states, page-ins and copies the step would otherwise wait for. With `pin` the batch is collated into pinned
    memory the calling thread allocates (a CUDA call, kept off the worker, which only copies), and copied to the
    GPU on a side stream: the copy overlaps the step before instead of delaying the next."""

    def __init__(self, store, lm_head: torch.nn.Module | None = None, pin: bool = False):
        self.store = store
        self.ids = store.ids()
        self.lengths = [e.length for shard in store.manifest.shards for e in shard.samples]
        self.lm_head = lm_head
        self.pin = pin
        self._copy_stream: torch.cuda.Stream | None = None  # pinned batches go to the GPU on it, beside the step
        self._worker: ThreadPoolExecutor | None = None
        self._pending: dict[tuple, Future] = {}

    def prefetch(self, indices: list[int]) -> None:
        """Start reading and collating the batch `load` will ask for next, in the store's layer order (the
        trainer's); at most one batch ahead: one never asked for is dropped."""
        layer_ids = list(self.store.manifest.meta.layer_ids)
        key = (tuple(indices), tuple(layer_ids))
        if key in self._pending:
            return
        self._pending.clear()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstap-store-batch")
        into = self.allocate(indices, layer_ids)
        self._pending[key] = self._worker.submit(self.fill, into, list(indices), layer_ids)

    def load(self, indices: list[int], layer_ids: list[int], device: torch.device) -> TTTBatch:
        """The batch of `indices` on `device`: the prefetched one if `prefetch` saw it (its errors raised here),
        else read now."""
        pending = self._pending.pop((tuple(indices), tuple(layer_ids)), None)
        if pending is not None:
            host = pending.result()
        else:
            host = self.fill(self.allocate(indices, layer_ids), indices, layer_ids)
        if self.pin and device.type == "cuda" and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return host.to(device, self.lm_head, self._copy_stream if device.type == "cuda" else None)

    def allocate(self, indices: list[int], layer_ids: list[int]) -> HostBatch:
        """Uninitialised host tensors for the batch of `indices`, shaped from the manifest (pinned with `pin`)."""
        specs = self.store.manifest.tensors
        b, s = len(indices), max(self.lengths[i] for i in indices)
        hidden = specs[hidden_name(layer_ids[0])]
        aux_dtype = torch_dtype(hidden.dtype)
        teacher = specs.get("teacher.hidden")
        k = 0 if teacher is not None else specs["teacher.topk_ids"].shape[-1]
        batch = empty_batch(b, s, len(layer_ids) * hidden.shape[-1], aux_dtype, k, self.pin)
        scales = (torch.empty(b, s, len(layer_ids), pin_memory=self.pin)
                  if f"{SCALE_PREFIX}{layer_ids[0]}" in specs else None)
        teacher_hidden = (torch.empty(b, s, teacher.shape[-1], dtype=torch_dtype(teacher.dtype), pin_memory=self.pin)
                          if teacher is not None else None)
        return HostBatch(batch, scales, teacher_hidden)

    def fill(self, host: HostBatch, indices: list[int], layer_ids: list[int]) -> HostBatch:
        """Read `indices` into `host` (CPU work only: safe on the worker thread)."""
        return fill_host([self.store.read(i, dequantize=False) for i in indices], layer_ids, host)

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.store.read(index, keys={"input_ids", "loss_mask"})
        return s["input_ids"], s["loss_mask"]


def fill_host(samples: list[dict], layer_ids: list[int], host: HostBatch | None = None) -> HostBatch:
    """Store-format samples → a HostBatch (written into `host` if given, else allocated like them). fp8 states stay
    fp8 (1 byte a value to copy) with their scales beside; a hidden teacher stays hidden (made top-k where lm_head
    lives, by `HostBatch.to`)."""
    first = samples[0]
    if host is None:
        b, s = len(samples), max(x["input_ids"].numel() for x in samples)
        state = first["hidden"][layer_ids[0]]
        teacher = first["teacher"].get("hidden")
        k = 0 if teacher is not None else first["teacher"]["topk_ids"].shape[-1]
        host = HostBatch(empty_batch(b, s, len(layer_ids) * state.shape[-1], state.dtype, k),
                         torch.empty(b, s, len(layer_ids)) if "hidden_scale" in first else None,
                         torch.empty(b, s, teacher.shape[-1], dtype=teacher.dtype) if teacher is not None else None)
    for row, sample in enumerate(samples):
        n = sample["input_ids"].numel()
        if host.teacher_hidden is not None:
            host.teacher_hidden[row, :n] = sample["teacher"]["hidden"]
            host.teacher_hidden[row, n:] = 0
            sample["teacher"] = {"topk_ids": torch.zeros(n, 0, dtype=torch.int32), "topk_logprobs": torch.zeros(n, 0)}
        if host.scales is not None:
            host.scales[row, :n] = torch.stack([sample["hidden_scale"][k] for k in layer_ids], dim=-1)  # (S, n)
            host.scales[row, n:] = 0
    collate(samples, layer_ids, into=host.batch)
    return host


class OnlineSource:
    """Online through the capture path: each fetch prefills the requested samples with the tap on (pinned host
    copies, per-sample dicts); nothing touches disk. Training uses `hstap.train.online.DeviceOnlineSource`, which
    keeps everything on the device; this one is the reference it is tested against (and the benchmark's old path).

    The tap, dtype and teacher are the ones `hstap capture` uses, so a sample fetched here equals the stored one up
    to the batch it was prefilled in (padding changes fp32 summation order, then bf16 rounding)."""

    def __init__(self, target, samples: list[RenderedSample], layer_ids: list[int], dtype: str = "bf16",
                 teacher: TeacherSpec | None = None, device: str = "cpu"):
        self.target = target
        self.samples = samples
        self.ids = [s.id for s in samples]
        self.lengths = [len(s.input_ids) for s in samples]
        self.layer_ids = layer_ids
        self.dtype = dtype
        self.teacher = teacher or TeacherSpec()
        self.device = device

    def fetch(self, indices: list[int]) -> list[dict]:
        from hstap.capture.run import prefill_with_tap

        got: dict[str, dict] = {}
        todo = [self.samples[i] for i in indices]
        report = prefill_with_tap(self.target, todo, self.layer_ids, self.teacher, got.__setitem__, dtype=self.dtype,
                                  batch_tokens=10**9, device=self.device, progress=False)
        if report.errors or len(got) != len(todo):
            raise HstapError(f"online capture failed: {report.summary()}")
        return [_as_store_sample(sid, got[sid], self.layer_ids) for sid in (s.id for s in todo)]

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.samples[index]
        return torch.tensor(s.input_ids, dtype=torch.long), torch.tensor(s.loss_mask, dtype=torch.bool)


def _as_store_sample(sample_id: str, tensors: dict[str, torch.Tensor], layer_ids: list[int]) -> dict:
    """Tap output (flat names) → the nested dict `Store.read(i, dequantize=False)` returns."""
    sample = {
        "id": sample_id,
        "input_ids": tensors["input_ids"].long(),
        "loss_mask": tensors["loss_mask"].bool(),
        "hidden": {k: tensors[hidden_name(k)] for k in layer_ids},
        "teacher": {name[8:]: t for name, t in tensors.items() if name.startswith("teacher.")},
    }
    if scale_name(layer_ids[0]) in tensors:  # an fp8 tap
        sample["hidden_scale"] = {k: tensors[scale_name(k)] for k in layer_ids}
    return sample


def split_heldout(ids: list[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/held-out split by a hash of (seed, id): stable when the data grow or are reordered."""
    heldout, train = [], []
    for i, sample_id in enumerate(ids):
        h = int(hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (heldout if h < fraction else train).append(i)
    return train, heldout


BUCKET = 1024  # samples per sorting window. A window's last batch is a leftover, part empty: a window must hold
# many batches. E.g. answers of ~450 tokens in 32,768-token batches: 64 samples make 1.4 batches, and the average
# step carried 44 % of its token budget; 1024 samples make ~14, and it carried 88 % (in half the steps).


def plan_batches(indices: list[int], lengths: list[int], batch_tokens: int, seed: int, epoch: int,
                 world_size: int = 1, bucket: int = BUCKET) -> list[list[int]]:
    """Length-bucketed batches: shuffle, sort inside windows of `bucket` samples by length, cut by padded tokens,
    shuffle the batches. Equal batch counts per rank (the last few are dropped) so DDP ranks stay in step.

    Each window ends in a partial batch, so a window must hold many batches' worth of samples (see BUCKET)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = indices[:]
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), bucket):
        window = sorted(order[w:w + bucket], key=lambda i: lengths[i])
        batch: list[int] = []
        longest = 0
        for i in window:
            if batch and max(longest, lengths[i]) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, lengths[i])
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    usable = len(batches) - len(batches) % world_size
    return batches[:usable]
