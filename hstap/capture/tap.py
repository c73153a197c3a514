"""The engine-agnostic tap: take layer outputs of one forward, keep the real tokens, hand them off without a sync.

An engine adapter (transformers hooks, SGLang `--forward-hooks`, a vLLM worker extension) does three things:
`tap.begin(batch)` before a prefill forward (which samples sit where), `tap.record(name, tensor)` from its hooks,
and nothing else. The tap:

- gathers the real tokens of every sample out of the padded `[B, S, H]` or packed `[T, H]` layout,
- converts to the storage dtype (fp8: quantises with per-token scales) and reduces teacher logits to top-k *on
  the device*, so only the bytes that will be stored cross PCIe,
- on CUDA copies on a side stream into pinned host memory (`non_blocking=True`, `record_stream`, an event) and
  returns at once: no `.cpu()`, `.item()` or `.tolist()` in the forward,
- lets a writer thread wait on the event, split the batch per sample and call the sink (usually the store),
- never raises into the engine: every failure is caught, counted and reported by `close()`.

The tap never touches what the model returns: it only reads the tensors it is given.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from hstap.capture.teacher import topk_logprobs
from hstap.config import TeacherSpec, dtype_name, torch_dtype
from hstap.store import fp8
from hstap.store.estimate import bytes_per_token, capture_specs, teacher_hidden_dtype
from hstap.store.names import hidden_layer, scale_name

Sink = Callable[[str, dict[str, torch.Tensor]], None]

@dataclass
class Batch:
    """Where each sample's real tokens sit in the tensors a forward produces.

    `rows[i]`/`starts[i]`/`lengths[i]`: sample i occupies `tensor[rows[i], starts[i]:starts[i]+lengths[i]]` of a
    padded `[B, S, ...]` output; for a packed `[T, ...]` output use rows = 0 and starts = the packing offsets.
    `host` holds per-sample tensors the adapter already has on the host (input_ids, loss_mask), stored as-is.
    """

    ids: list[str]
    rows: list[int]
    starts: list[int]
    lengths: list[int]
    host: list[dict[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class TapReport:
    """What happened, for the end-of-run summary. Nothing the tap drops goes uncounted."""

    batches: int = 0
    samples_written: int = 0
    errors: int = 0
    dropped_samples: int = 0
    first_error: str = ""

    def summary(self) -> str:
        s = f"tap: {self.samples_written} samples handed off in {self.batches} batches"
        if self.errors or self.dropped_samples:
            s += f"; {self.errors} errors, {self.dropped_samples} samples dropped (first error: {self.first_error})"
        return s


class _Pending:
    """One in-flight forward: device-side gathered tensors on their way to the host."""

    def __init__(self, batch: Batch, expected: set[str], nbytes_per_token: int):
        self.batch = batch
        self.expected = expected
        self.recorded: set[str] = set()
        self.host_tensors: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.nbytes = nbytes_per_token * sum(batch.lengths)
        self.failed = False
        self.admitted = False


class Tap:
    """Collects the named tensors of each prefill batch and streams them, per sample, into `sink`.

    Args:
        names: tensor names one forward must produce, e.g. {"hidden.1", "hidden.14", "hidden.26", "teacher"}.
        sink: called on the writer thread as `sink(sample_id, tensors)`; tensors are on the host.
        storage_dtype: dtype hidden states are stored in (teacher log-probs are always fp16, ids int32);
            float8_e4m3fn stores each layer as fp8 plus `hidden_scale.{k}` (hstap.store.fp8), quantised on the device.
        teacher: how `record("teacher", ...)` is reduced (top-k of the logits, or the normed hidden as-is).
        max_inflight_bytes: host memory the tap may hold in flight; past it a batch is dropped (and counted)
            rather than blocking inside the engine's forward. Offline loops call `wait_capacity()` between forwards.
        on_batch: called on the writer thread once every sample of a batch went to `sink` (capture commits there
            when `--commit-every` is due, so a whole batch is kept at once).
    """

    def __init__(self, names: set[str], sink: Sink, storage_dtype: torch.dtype = torch.bfloat16,
                 teacher: TeacherSpec | None = None, hidden_size: int = 0, max_inflight_bytes: int = 2 << 30,
                 on_batch: Callable[[], None] | None = None):
        self.names = set(names)
        self.sink = sink
        self.on_batch = on_batch
        self.storage_dtype = storage_dtype
        self.teacher = teacher or TeacherSpec()
        self._teacher_dtype = torch_dtype(teacher_hidden_dtype(dtype_name(storage_dtype)))
        self.max_inflight_bytes = max_inflight_bytes
        self.report = TapReport()
        self._bytes_per_token = self._estimate_bytes_per_token(hidden_size)
        self._current: _Pending | None = None
        self._index_cache: dict[str, torch.Tensor] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._side_stream: torch.cuda.Stream | None = None
        self._writer = threading.Thread(target=self._drain, name="hstap-tap-writer", daemon=True)
        self._writer.start()

    # ---- engine-facing (forward thread) -------------------------------------------------------------------

    def begin(self, batch: Batch) -> None:
        """Announce the next prefill forward's layout. Must not be called for decode/warmup passes."""
        self._index_cache.clear()
        self._current = _Pending(batch, set(self.names), self._bytes_per_token)

    def active(self) -> bool:
        return self._current is not None

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Called from a hook with a layer output; returns at once and never raises."""
        pending = self._current
        if pending is None or pending.failed or name not in pending.expected:
            return
        try:
            if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
                return  # CUDA-graph capture: tensors are placeholders, and a copy would be baked into the graph
            if torch.compiler.is_compiling():
                return
            if name in pending.recorded:
                return  # a module called twice in one forward: keep the first
            if not pending.recorded and not self._admit(pending):
                return
            self._copy_out(pending, name, tensor)
            pending.recorded.add(name)
            if pending.expected <= pending.recorded:
                self._current = None
                self._queue.put(pending)
        except Exception as exc:  # noqa: BLE001 — a hook must never raise into the engine
            self._fail(pending, exc)

    def end(self) -> None:
        """The forward is over: a batch that did not produce every expected tensor is dropped and counted."""
        pending, self._current = self._current, None
        if pending is not None and not pending.failed and not pending.expected <= pending.recorded:
            missing = sorted(pending.expected - pending.recorded)
            self._fail(pending, RuntimeError(f"forward ended without producing {missing}"))

    # ---- caller-facing ------------------------------------------------------------------------------------

    def wait_capacity(self, max_pending_bytes: int | None = None) -> None:
        """Block (between forwards, never inside one) until in-flight host memory is below the bound."""
        bound = self.max_inflight_bytes // 2 if max_pending_bytes is None else max_pending_bytes
        with self._drained:
            self._drained.wait_for(lambda: self._inflight <= bound)

    def close(self) -> TapReport:
        """Finish every pending write and stop the writer thread."""
        self.end()
        self._queue.put(None)
        self._writer.join()
        return self.report

    # ---- internals ----------------------------------------------------------------------------------------

    def _estimate_bytes_per_token(self, hidden_size: int) -> int:
        layers = list(range(sum(hidden_layer(n) is not None for n in self.names)))
        return bytes_per_token(capture_specs(layers, hidden_size, dtype_name(self.storage_dtype), self.teacher))

    def _admit(self, pending: _Pending) -> bool:
        with self._lock:
            if self._inflight + pending.nbytes > self.max_inflight_bytes and self._inflight > 0:
                pending.failed = True
                self.report.dropped_samples += len(pending.batch.ids)
                self.report.first_error = self.report.first_error or "host buffer full (writer behind)"
                return False
            self._inflight += pending.nbytes
            pending.admitted = True
            return True

    def _token_index(self, tensor: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Flat row indices of the real tokens, built once per batch and device (host → device, non-blocking)."""
        seq = tensor.shape[1] if tensor.dim() == 3 else 0
        key = f"{tensor.device}:{seq}"
        idx = self._index_cache.get(key)
        if idx is None:
            lengths = torch.tensor(batch.lengths, dtype=torch.long)
            base = torch.tensor(batch.rows, dtype=torch.long) * seq + torch.tensor(batch.starts, dtype=torch.long)
            first = torch.cumsum(lengths, 0) - lengths  # where each sample starts in the packed output
            within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(first, lengths)
            idx = torch.repeat_interleave(base, lengths) + within  # (T,) flat row of every real token
            if tensor.is_cuda:
                idx = idx.pin_memory().to(tensor.device, non_blocking=True)
            self._index_cache[key] = idx
        return idx

    def _reduce(self, name: str, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Device-side: storage dtype for hidden states, top-k log-probs for teacher logits; integer tensors
        (an engine's token ids, recorded so the sink can tell which request a row belongs to) keep their dtype."""
        if not rows.is_floating_point():
            return {name: rows}
        if name != "teacher":
            if self.storage_dtype == fp8.FP8:
                q, scale = fp8.quantize(rows)  # (T, H) fp8, (T,) fp32
                return {name: q, scale_name(hidden_layer(name)): scale}
            return {name: rows.to(self.storage_dtype)}
        if self.teacher.kind == "hidden":
            return {"teacher.hidden": rows.to(self._teacher_dtype)}
        values, ids = topk_logprobs(rows, self.teacher.k)  # (T, k): no (T, V) fp32 log-probs
        return {"teacher.topk_ids": ids.to(torch.int32), "teacher.topk_logprobs": values.to(torch.float16)}

    def _copy_out(self, pending: _Pending, name: str, tensor: torch.Tensor) -> None:
        flat = tensor if tensor.dim() == 1 else tensor.reshape(-1, tensor.shape[-1])  # (B*S or T, H), or (T,)
        if not tensor.is_cuda:
            rows = flat.index_select(0, self._token_index(tensor, pending.batch))
            pending.host_tensors.update(self._reduce(name, rows))
            return
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=tensor.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            rows = flat.index_select(0, self._token_index(tensor, pending.batch))
            for key, value in self._reduce(name, rows).items():
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value, non_blocking=True)
                pending.host_tensors[key] = host
        tensor.record_stream(side)  # the engine may free `tensor` right after the hook; keep it alive for the copy
        event = torch.cuda.Event()
        event.record(side)
        pending.event = event

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        if not pending.failed:
            pending.failed = True
            self.report.dropped_samples += len(pending.batch.ids)
            if pending.admitted:
                self._release(pending)
        self.report.errors += 1
        self.report.first_error = self.report.first_error or f"{type(exc).__name__}: {exc}"

    def _release(self, pending: _Pending) -> None:
        with self._drained:
            self._inflight -= pending.nbytes
            self._drained.notify_all()

    def _drain(self) -> None:
        while (pending := self._queue.get()) is not None:
            try:
                if pending.event is not None:
                    pending.event.synchronize()  # the writer waits, never the forward
                self._split_and_sink(pending)
                if self.on_batch is not None:
                    self.on_batch()
                self.report.batches += 1
            except Exception as exc:  # noqa: BLE001 — a failing sink must not kill the writer
                self.report.errors += 1
                self.report.dropped_samples += len(pending.batch.ids)
                self.report.first_error = self.report.first_error or f"{type(exc).__name__}: {exc}"
            finally:
                self._release(pending)

    def _split_and_sink(self, pending: _Pending) -> None:
        batch = pending.batch
        offset = 0
        for i, (sample_id, n) in enumerate(zip(batch.ids, batch.lengths)):
            tensors = {key: value[offset:offset + n] for key, value in pending.host_tensors.items()}
            if batch.host:
                tensors.update(batch.host[i])
            offset += n
            self.sink(sample_id, tensors)
            self.report.samples_written += 1
