"""`hstap capture`: render conversations, prefill them through the embedded target with the tap on, store the result.

    hstap capture --model smollm2 --data sharegpt --limit 200 --out runs/cap --layers auto --dtype bf16
    torchrun --nproc_per_node 2 -m hstap.cli capture --model DIR --out runs/cap      # tensor-parallel target

Re-running the same command on the same `--out` resumes: committed samples are skipped, nothing is duplicated.
Everything that needs no weights — the store lock, the store's state, the layer range, the disk estimate — is
checked before the model loads, so a refusal costs a second, not a model load. SIGTERM and SIGINT stop after the
batch in flight with the buffer committed (hstap.capture.stop); shards also commit every `--commit-every`.
Under torchrun the target is split over the ranks (transformers' tensor-parallel plan); every rank runs the same
forwards, and only rank 0 taps and writes: the residual stream is whole on every rank, so one copy is enough.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from hstap.capture.config import CaptureConfig
from hstap.capture.hf import hf_taps
from hstap.capture.layers import parse_layers
from hstap.capture.stop import GuardedSink, StopSignals
from hstap.capture.tap import Batch, Tap, TapReport
from hstap.config import TeacherSpec, torch_dtype
from hstap.data import RenderedSample, SkipReport, render_all
from hstap.errors import HstapError
from hstap.faults import fault_point
from hstap.metrics import tokens_per_second
from hstap.models import load_target, load_tokenizer
from hstap.models.target import fingerprint_dir, model_config, resolve_model_dir
from hstap.preflight import check_device, check_out_dir
from hstap.progress import progress_bar
from hstap.store import StoreMeta, StoreWriter, bytes_per_token, capture_specs, check_free_space
from hstap.store.names import hidden_name


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
    notes: list[str] = field(default_factory=list)  # the store writer's: manifest rebuilt, shards set aside

    def summary(self) -> str:
        rate = tokens_per_second(self.tokens, self.seconds)
        lines = [
            f"captured {self.captured} samples ({self.tokens} tokens, {rate:.0f} tok/s) into {self.out}",
            f"resumed past {self.skipped_committed} already-committed samples" if self.skipped_committed else "",
            f"data: {self.data_report.summary()}",
            self.tap_report.summary(),
            f"removed leftovers of an interrupted run: {', '.join(self.cleaned)}" if self.cleaned else "",
            *(f"store: {note}" for note in self.notes),
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


@dataclass
class TargetFiles:
    """What the store meta and the checks before the model load need, read from the checkpoint's files alone."""

    model_id: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None = None  # None where config.json does not say


def target_files(model: str) -> TargetFiles:
    path, model_id = resolve_model_dir(model)
    config = model_config(model)
    try:
        num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    except KeyError as e:
        raise HstapError(f"{path / 'config.json'} has no {e.args[0]}: not a decoder-only LM config") from None
    vocab = config.get("vocab_size")
    return TargetFiles(model_id, fingerprint_dir(path), num_layers, hidden, int(vocab) if vocab else None)


def check_teacher(teacher: TeacherSpec, files: TargetFiles, model: str) -> None:
    """A top-k teacher's k fits the target's vocabulary: checked before anything is rendered, loaded or written
    (`topk:100000` against SmolLM2's 49,152 tokens used to run, store nothing and pin k in an empty store)."""
    if teacher.kind == "topk" and files.vocab_size is not None and teacher.k > files.vocab_size:
        raise HstapError(f"--teacher {teacher}: k must be at most the vocabulary of --model {model} "
                         f"({files.vocab_size:,} tokens); topk:32 is the usual choice")


def capture_meta(target, layer_ids: list[int], cfg: CaptureConfig, teacher: TeacherSpec) -> StoreMeta:
    return StoreMeta(model_id=target.model_id, model_fingerprint=target.fingerprint, layer_ids=layer_ids,
                     hidden_size=target.hidden_size, hidden_dtype=cfg.dtype, teacher=teacher,
                     extra={"data": cfg.data, "max_tokens": cfg.max_tokens, "loops": cfg.loops,
                            "target_dtype": target_dtype_name(cfg)})


def target_dtype_name(cfg: CaptureConfig) -> str:
    """What the target computes in: `--target-dtype`, else load_target's default for the device."""
    return cfg.target_dtype or ("fp32" if cfg.device == "cpu" else "bf16")


def run_capture(cfg: CaptureConfig, progress: bool = True) -> CaptureResult:
    """Capture `cfg.data` through `cfg.model` into the store at `cfg.out` (resuming if it exists)."""
    check_out_dir(cfg.out)  # before rendering and the model load: a bad --out or --device fails in a second
    check_device(cfg.device)
    teacher = cfg.teacher
    files = target_files(cfg.model)
    check_teacher(teacher, files, cfg.model)
    report = SkipReport()
    samples = render_all(cfg.data, load_tokenizer(cfg.model), report, max_tokens=cfg.max_tokens,
                         overlong=cfg.overlong, limit=cfg.limit, loops=cfg.loops)
    if not samples:
        raise HstapError(f"--data {cfg.data}: no usable conversations ({report.summary()})")
    parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1
    layer_ids = parse_layers(cfg.layers, files.num_layers)
    if parallel and int(os.environ.get("RANK", "0")) != 0:
        with StopSignals() as stop:
            target = load_target(cfg.model, device=cfg.device, dtype=torch_dtype(target_dtype_name(cfg)),
                                 tensor_parallel=parallel)
            result = _follow_rank0(target, samples, cfg, report, stop)
        stop.raise_if_stopped(f"rank {os.environ['RANK']} stopped with rank 0, which commits the store")
        return result
    meta = capture_meta(files, layer_ids, cfg, teacher)
    with StopSignals() as stop, \
            StoreWriter(cfg.out, meta, shard_bytes=int(cfg.shard_mb * 2**20), commit_every_s=cfg.commit_every,
                        repair=cfg.repair) as writer:
        todo = [s for s in samples if s.id not in writer.committed_ids]
        tokens = sum(len(s.input_ids) for s in todo)
        per_token = bytes_per_token(capture_specs(layer_ids, files.hidden_size, cfg.dtype, teacher))
        print(f"hstap capture: {len(todo)} samples, {tokens} tokens to go; estimated disk use "
              f"{per_token * tokens / 2**20:.1f} MiB ({per_token} B/token) in {cfg.out}", flush=True)
        warning = check_free_space(cfg.out, per_token * tokens, cfg.force)
        if warning:
            print(f"hstap capture: warning: {warning}", flush=True)
        fault_point("capture-checked")
        tap_report, seconds = TapReport(), 0.0
        if todo or parallel:  # a finished store needs no model
            target = load_target(cfg.model, device=cfg.device, dtype=torch_dtype(target_dtype_name(cfg)),
                                 tensor_parallel=parallel)
            fault_point("model-loaded")
            if parallel:  # the other ranks run exactly these forwards
                torch.distributed.broadcast_object_list([[s.id for s in todo]], src=0)
            sink = GuardedSink(writer)
            stop.defer()
            start = time.perf_counter()
            tap_report = prefill_with_tap(target, todo, layer_ids, teacher, sink, dtype=cfg.dtype,
                                          batch_tokens=cfg.batch_tokens, device=cfg.device, progress=progress,
                                          stop=lambda: stop.agree(failed=sink.error is not None),
                                          on_batch=sink.batch_done)
            seconds = time.perf_counter() - start
            if sink.error is not None:
                writer.discard()  # its commit failed: those samples are captured again on resume
                raise sink.error
    stop.raise_if_stopped(f"{len(writer.committed_ids)} samples committed in {cfg.out} (the buffer included); "
                          "re-run the same command to resume")
    return CaptureResult(out=cfg.out, captured=tap_report.samples_written, skipped_committed=len(samples) - len(todo),
                         tokens=tokens, seconds=seconds, data_report=report, tap_report=tap_report,
                         cleaned=list(writer.cleaned), notes=list(writer.notes))


def _follow_rank0(target, samples: list[RenderedSample], cfg: CaptureConfig, report: SkipReport,
                  stop: StopSignals) -> CaptureResult:
    """A tensor-parallel rank other than 0: the same forwards as rank 0 (its collectives need them), no tap, no
    store. It never waits on the tap: rank 0's tap copies asynchronously and adds no collective. It stops after
    the batch rank 0 stops after (`StopSignals.agree`)."""
    todo_ids = [None]
    torch.distributed.broadcast_object_list(todo_ids, src=0)
    wanted = set(todo_ids[0])
    todo = [s for s in samples if s.id in wanted]
    stop.defer()
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in make_batches(todo, cfg.batch_tokens):
            if stop.agree():
                break
            inputs, _ = _to_model_inputs(batch, target.tokenizer.pad_token_id, cfg.device)
            target.model(**inputs, use_cache=False)
            fault_point("batch-followed")
    return CaptureResult(out=cfg.out, captured=0, skipped_committed=len(samples) - len(todo),
                         tokens=sum(len(s.input_ids) for s in todo), seconds=time.perf_counter() - start,
                         data_report=report, tap_report=TapReport(), cleaned=[])


def prefill_with_tap(target, todo: list[RenderedSample], layer_ids: list[int], teacher: TeacherSpec, sink,
                     dtype: str, batch_tokens: int, device: str, progress: bool = True,
                     stop: Callable[[], bool] | None = None, on_batch: Callable[[], None] | None = None) -> TapReport:
    """Prefill every sample in padded batches of at most `batch_tokens` with the tap on, storing hidden states
    as `dtype`; the tap's writer thread feeds `sink(sample_id, tensors)`. Capture and online training share it.
    `stop`: asked before each batch; True ends the loop there (the tap still drains what it holds). `on_batch`:
    called on the tap's writer thread once a batch's samples all went to `sink` (capture's `--commit-every`)."""
    names = {hidden_name(k) for k in layer_ids} | {"teacher"}
    tap = Tap(names, sink=sink, storage_dtype=torch_dtype(dtype), teacher=teacher, hidden_size=target.hidden_size,
              on_batch=on_batch)
    bar = progress_bar(total=sum(len(s.input_ids) for s in todo), unit="tok", unit_scale=True, desc="capture",
                       disable=not progress)
    try:
        with hf_taps(target.model, tap, layer_ids, teacher.kind) as fired, torch.inference_mode():
            for batch in make_batches(todo, batch_tokens):
                if stop is not None and stop():
                    break
                inputs, layout = _to_model_inputs(batch, target.tokenizer.pad_token_id, device)
                tap.wait_capacity()
                tap.begin(layout)
                target.model(**inputs, use_cache=False)
                tap.end()
                bar.update(sum(layout.lengths))
                fault_point("batch-forwarded")
                fired.requests += len(batch)
                if silent := fired.silent():  # hooks that never fire: stop now, not after an empty store
                    raise HstapError(fired.message(silent))
            if silent := fired.silent(finished=True):
                raise HstapError(fired.message(silent))
    finally:
        report = tap.close()
        bar.close()
    return report
