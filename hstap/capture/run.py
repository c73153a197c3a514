"""`hstap capture`: render conversations, prefill them through the embedded target with the tap on, store the result.

    hstap capture --model smollm2 --data sharegpt --limit 200 --out runs/cap --layers auto --dtype bf16
    torchrun --nproc_per_node 2 -m hstap.cli capture --model DIR --out runs/cap      # tensor-parallel target

Re-running the same command on the same `--out` resumes: committed samples are skipped, nothing is duplicated.
Under torchrun the target is split over the ranks (transformers' tensor-parallel plan); every rank runs the same
forwards, and only rank 0 taps and writes: the residual stream is whole on every rank, so one copy is enough.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from hstap.capture.config import CaptureConfig
from hstap.capture.hf import hf_taps
from hstap.capture.layers import parse_layers
from hstap.capture.tap import Batch, Tap, TapReport
from hstap.config import TeacherSpec, torch_dtype
from hstap.data import RenderedSample, SkipReport, render_all
from hstap.errors import HstapError
from hstap.metrics import tokens_per_second
from hstap.models import load_target, load_tokenizer
from hstap.store import StoreMeta, StoreWriter, bytes_per_token, capture_specs, check_free_space


@dataclass
class CaptureResult:
    out: Path
    captured: int
    skipped_committed: int
    tokens: int
    seconds: float
    data_report: SkipReport
    tap_report: TapReport
    cleaned: list[str]

    def summary(self) -> str:
        rate = tokens_per_second(self.tokens, self.seconds)
        lines = [
            f"captured {self.captured} samples ({self.tokens} tokens, {rate:.0f} tok/s) into {self.out}",
            f"resumed past {self.skipped_committed} already-committed samples" if self.skipped_committed else "",
            f"data: {self.data_report.summary()}",
            self.tap_report.summary(),
            f"removed leftovers of an interrupted run: {', '.join(self.cleaned)}" if self.cleaned else "",
        ]
        return "\n".join(line for line in lines if line)


def make_batches(samples: list[RenderedSample], batch_tokens: int) -> Iterator[list[RenderedSample]]:
    """Consecutive samples while the padded batch (count × longest) fits in `batch_tokens`; order is kept so the
    store's order matches the source's."""
    batch: list[RenderedSample] = []
    longest = 0
    for sample in samples:
        n = len(sample.input_ids)
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(sample)
        longest = max(longest, n)
    if batch:
        yield batch


def _to_model_inputs(batch: list[RenderedSample], pad_id: int, device: str) -> tuple[dict, Batch]:
    longest = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    host = []
    for row, s in enumerate(batch):
        n = len(s.input_ids)
        sample_ids = torch.tensor(s.input_ids, dtype=torch.long)
        ids[row, :n] = sample_ids  # right padding: real tokens keep positions 0..n-1
        mask[row, :n] = 1
        host.append({"input_ids": sample_ids.to(torch.int32), "loss_mask": torch.tensor(s.loss_mask)})
    layout = Batch(ids=[s.id for s in batch], rows=list(range(len(batch))), starts=[0] * len(batch),
                   lengths=[len(s.input_ids) for s in batch], host=host)
    pin = device.startswith("cuda")
    inputs = {"input_ids": (ids.pin_memory() if pin else ids).to(device, non_blocking=pin),
              "attention_mask": (mask.pin_memory() if pin else mask).to(device, non_blocking=pin)}
    return inputs, layout


def capture_meta(target, layer_ids: list[int], cfg: CaptureConfig, teacher: TeacherSpec) -> StoreMeta:
    return StoreMeta(model_id=target.model_id, model_fingerprint=target.fingerprint, layer_ids=layer_ids,
                     hidden_size=target.hidden_size, hidden_dtype=cfg.dtype, teacher=teacher,
                     extra={"data": cfg.data, "max_tokens": cfg.max_tokens})


def run_capture(cfg: CaptureConfig, progress: bool = True) -> CaptureResult:
    """Capture `cfg.data` through `cfg.model` into the store at `cfg.out` (resuming if it exists)."""
    teacher = cfg.teacher
    report = SkipReport()
    samples = render_all(cfg.data, load_tokenizer(cfg.model), report, max_tokens=cfg.max_tokens,
                         overlong=cfg.overlong, limit=cfg.limit)
    if not samples:
        raise HstapError(f"--data {cfg.data}: no usable conversations ({report.summary()})")
    parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1
    target = load_target(cfg.model, device=cfg.device, tensor_parallel=parallel)
    layer_ids = parse_layers(cfg.layers, target.num_layers)
    if parallel and torch.distributed.get_rank() != 0:
        return _follow_rank0(target, samples, cfg, report)
    meta = capture_meta(target, layer_ids, cfg, teacher)
    with StoreWriter(cfg.out, meta, shard_bytes=int(cfg.shard_mb * 2**20)) as writer:
        todo = [s for s in samples if s.id not in writer.committed_ids]
        if parallel:  # the other ranks run exactly these forwards
            torch.distributed.broadcast_object_list([[s.id for s in todo]], src=0)
        tokens = sum(len(s.input_ids) for s in todo)
        per_token = bytes_per_token(capture_specs(layer_ids, target.hidden_size, cfg.dtype, teacher))
        print(f"hstap capture: {len(todo)} samples, {tokens} tokens to go; estimated disk use "
              f"{per_token * tokens / 2**20:.1f} MiB ({per_token} B/token) in {cfg.out}", flush=True)
        warning = check_free_space(cfg.out, per_token * tokens, cfg.force)
        if warning:
            print(f"hstap capture: warning: {warning}", flush=True)
        start = time.perf_counter()
        tap_report = prefill_with_tap(target, todo, layer_ids, teacher, writer.add, dtype=cfg.dtype,
                                      batch_tokens=cfg.batch_tokens, device=cfg.device, progress=progress)
        seconds = time.perf_counter() - start
    return CaptureResult(out=cfg.out, captured=tap_report.samples_written, skipped_committed=len(samples) - len(todo),
                         tokens=tokens, seconds=seconds, data_report=report, tap_report=tap_report,
                         cleaned=list(writer.cleaned))


def _follow_rank0(target, samples: list[RenderedSample], cfg: CaptureConfig, report: SkipReport) -> CaptureResult:
    """A tensor-parallel rank other than 0: the same forwards as rank 0 (its collectives need them), no tap, no
    store. It never waits on the tap: rank 0's tap copies asynchronously and adds no collective."""
    todo_ids = [None]
    torch.distributed.broadcast_object_list(todo_ids, src=0)
    wanted = set(todo_ids[0])
    todo = [s for s in samples if s.id in wanted]
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in make_batches(todo, cfg.batch_tokens):
            inputs, _ = _to_model_inputs(batch, target.tokenizer.pad_token_id, cfg.device)
            target.model(**inputs, use_cache=False)
    return CaptureResult(out=cfg.out, captured=0, skipped_committed=len(samples) - len(todo),
                         tokens=sum(len(s.input_ids) for s in todo), seconds=time.perf_counter() - start,
                         data_report=report, tap_report=TapReport(), cleaned=[])


def prefill_with_tap(target, todo: list[RenderedSample], layer_ids: list[int], teacher: TeacherSpec, sink,
                     dtype: str = "bf16", batch_tokens: int = 4096, device: str = "cpu",
                     progress: bool = True) -> TapReport:
    """Prefill every sample in padded batches of at most `batch_tokens` with the tap on, storing hidden states
    as `dtype`; the tap's writer thread feeds `sink(sample_id, tensors)`. Capture and online training share it."""
    names = {f"hidden.{k}" for k in layer_ids} | {"teacher"}
    tap = Tap(names, sink=sink, storage_dtype=torch_dtype(dtype), teacher=teacher, hidden_size=target.hidden_size)
    bar = tqdm(total=sum(len(s.input_ids) for s in todo), unit="tok", unit_scale=True, desc="capture",
               disable=not progress)
    try:
        with hf_taps(target.model, tap, layer_ids, teacher.kind) as fired, torch.inference_mode():
            for batch in make_batches(todo, batch_tokens):
                inputs, layout = _to_model_inputs(batch, target.tokenizer.pad_token_id, device)
                tap.wait_capacity()
                tap.begin(layout)
                target.model(**inputs, use_cache=False)
                tap.end()
                bar.update(sum(layout.lengths))
                fired.requests += len(batch)
                if silent := fired.silent():  # hooks that never fire: stop now, not after an empty store
                    raise HstapError(fired.message(silent))
            if silent := fired.silent(finished=True):
                raise HstapError(fired.message(silent))
    finally:
        report = tap.close()
        bar.close()
    return report
