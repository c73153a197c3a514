"""Where training samples come from — a store on disk (offline) or the target in this process (online) — and the
length-bucketed batch plan both share, so the same seed gives the same batches either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Protocol, runtime_checkable

import torch

from hstap.capture.teacher import topk_logprobs
from hstap.config import TeacherSpec
from hstap.data import RenderedSample
from hstap.errors import HstapError
from hstap.store.fp8 import dequantize_aux
from hstap.train.ttt import TTTBatch, collate


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


def load_batch(source: SampleSource | BatchSource, indices: list[int], layer_ids: list[int],
               device: torch.device) -> TTTBatch:
    """The batch of `indices` on `device`: a BatchSource makes it there; host samples are collated, then copied.
    fp8 samples (hstap.store.fp8) are collated and copied as fp8 plus scales and dequantised to bf16 on `device`:
    the host and the copy handle 1 byte per value, the device's arithmetic does the rest."""
    if isinstance(source, BatchSource):
        return source.batch(indices)
    samples = source.fetch(indices)
    batch = collate(samples, layer_ids).to(device)
    if "hidden_scale" not in samples[0]:
        return batch
    scales = collate_scales(samples, layer_ids).to(device, non_blocking=True)  # (B, S, n)
    return dataclasses.replace(batch, aux=dequantize_aux(batch.aux, scales))


def collate_scales(samples: list[dict], layer_ids: list[int]) -> torch.Tensor:
    """The fp8 scales of `samples`, right-padded like `collate`'s aux: (B, S, n layers) fp32, 0 at padding."""
    longest = max(s["input_ids"].numel() for s in samples)
    scales = torch.zeros(len(samples), longest, len(layer_ids))
    for row, s in enumerate(samples):
        n = s["input_ids"].numel()
        scales[row, :n] = torch.stack([s["hidden_scale"][k] for k in layer_ids], dim=-1)  # (S, n)
    return scales


def topk_teacher_from_hidden(hidden: torch.Tensor, lm_head: torch.nn.Module, k: int = 32) -> dict[str, torch.Tensor]:
    """A store captured with `--teacher hidden` keeps the final normed state; the trainer wants top-k log-probs.
    Computed where `lm_head` lives (the training device when the target sits there), returned where `hidden` was."""
    weight = lm_head.weight
    with torch.no_grad():
        values, ids = topk_logprobs(lm_head(hidden.to(weight.device, weight.dtype)), k)  # (S, k) each
    return {"topk_ids": ids.to(hidden.device, torch.int32), "topk_logprobs": values.to(hidden.device, torch.float16)}


class StoreSource:
    """Offline: samples read lazily from a capture store."""

    def __init__(self, store, lm_head: torch.nn.Module | None = None):
        self.store = store
        self.ids = store.ids()
        self.lengths = [e.length for shard in store.manifest.shards for e in shard.samples]
        self.lm_head = lm_head

    def fetch(self, indices: list[int]) -> list[dict]:
        samples = [self.store.read(i, dequantize=False) for i in indices]  # fp8 stays fp8 until `load_batch`
        for s in samples:
            if "hidden" in s["teacher"]:
                if self.lm_head is None:
                    raise HstapError("store has a `hidden` teacher: the target's lm_head is needed (pass --model)")
                s["teacher"] = topk_teacher_from_hidden(s["teacher"]["hidden"], self.lm_head)
        return samples

    def token_masks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.store.read(index, keys={"input_ids", "loss_mask"})
        return s["input_ids"], s["loss_mask"]


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
        "hidden": {k: tensors[f"hidden.{k}"] for k in layer_ids},
        "teacher": {name[8:]: t for name, t in tensors.items() if name.startswith("teacher.")},
    }
    if f"hidden_scale.{layer_ids[0]}" in tensors:  # an fp8 tap
        sample["hidden_scale"] = {k: tensors[f"hidden_scale.{k}"] for k in layer_ids}
    return sample


def split_heldout(ids: list[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/held-out split by a hash of (seed, id): stable when the data grow or are reordered."""
    heldout, train = [], []
    for i, sample_id in enumerate(ids):
        h = int(hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (heldout if h < fraction else train).append(i)
    return train, heldout


BUCKET = 1024  # samples per sorting window. At 64, on the 2026-12-02 GPU recipe's 19,866 answers (mean 451 tokens)
# and 32,768-token batches, a window held 1.4 batches, and its leftover batch made the average step carry 14.4k real
# tokens (44 % of the budget, 58 % of the padded tokens real); at 1024, 28.8k (88 %, 91 %) in half the steps.


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
