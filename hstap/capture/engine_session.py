"""What every in-engine adapter (SGLang hooks, vLLM worker extension) shares: spans, identity, stitching, the store.

An engine's forward packs requests back to back (`[T, H]`), may split one request over several forwards (chunked
prefill) and carries no conversation ids. The adapter describes each prefill forward as `Span`s (offset, length,
tokens already in the KV cache, the engine's request id if it has one) and records the layer outputs plus the
forward's token ids into an `EngineSession`. The session's Tap copies them off the device without a sync; on the
Tap's writer thread the `Matcher` then

- identifies each request by its token ids against the samples the capture client announced in
  `DIR/requests.jsonl` (`{"id", "input_ids", "loss_mask"}` per line, written before the requests are sent), so
  warmup, health probes and foreign traffic match nothing and are dropped (counted as `unmatched`);
- stitches chunked prefill: a span with `prefix > 0` continues the open partial sample of that length (and of that
  request id when the engine has ids); one that continues nothing had its prefix served from the prefix cache and
  is refused (counted as `refused_prefix_cached`) rather than stored with holes;
- hands complete samples to the store, which is flushed whenever the engine has been idle for `flush_s` seconds, so
  a client can wait for its ids to show up in the manifest while the server keeps running.

Counters go to `DIR/engine-report.json` at every flush, whenever they change (so a client sees an engine that
runs forwards but captures nothing), and on close; a session that saw prefill requests and captured none says so
in one line on stderr (the engine's log) when it closes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from hstap.capture.arch import Layout
from hstap.capture.config import ENGINE_FLUSH_S, ENGINE_SHARD_MB
from hstap.capture.tap import Batch, Tap
from hstap.config import StoreDtype, TeacherSpec, torch_dtype
from hstap.store import StoreMeta, StoreWriter
from hstap.store.config import HIDDEN_DTYPE
from hstap.store.names import hidden_name

REQUESTS_NAME = "requests.jsonl"
REPORT_NAME = "engine-report.json"
HEAD = 16  # tokens that index a sample for prefix (first-chunk) lookups
MAX_PARTIALS = 256  # open chunked samples; past this the oldest is abandoned (counted)


class EngineCaptureConfig(BaseModel):
    """The capture settings an engine adapter receives (SGLang hook `config`, vLLM `install_taps` argument)."""

    model_config = ConfigDict(extra="forbid")

    out: Path
    layers: list[int]
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    dtype: StoreDtype = HIDDEN_DTYPE
    model_id: str = "unknown"
    fingerprint: str = "unknown"
    engine: str = "unknown"
    shard_mb: float = Field(default=ENGINE_SHARD_MB, gt=0)
    flush_s: float = Field(default=ENGINE_FLUSH_S, gt=0)
    # the served architecture's module names and layer-output contract in this engine (hstap.capture.arch)
    layout: Layout = Layout()
    # the engine release the layout was resolved for (SGLang's layer contracts changed in 0.5.21-0.5.22); None: the
    # default. The SGLang hook refuses to run in another release whose contract differs.
    engine_version: str | None = None

    @classmethod
    def for_checkpoint(cls, model: str, layers: str, out: Path, engine: str, engine_version: str | None = None,
                       **store: Any) -> "EngineCaptureConfig":
        """The config for a served checkpoint (`model`: 'smollm2' or a directory, which may hold config.json
        alone): layer ids validated against its config.json (nested `text_config` of wrapped models included),
        the engine's module layout for its `architectures`, the files fingerprinted like a store's. `store`: the
        store settings given (dtype, shard_mb, flush_s); the others keep this config's defaults."""
        from hstap.capture.arch import resolve_layout
        from hstap.capture.layers import parse_layers
        from hstap.errors import HstapError
        from hstap.models.target import fingerprint_dir, resolve_model_dir

        path, model_id = resolve_model_dir(model)
        try:
            top = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise HstapError(f"{path / 'config.json'}: not valid JSON ({e})") from None
        text = top.get("text_config", top)
        try:
            num_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        except KeyError as e:
            raise HstapError(f"{path / 'config.json'} has no {e.args[0]}: not a decoder-only LM config") from None
        return cls(out=Path(out).resolve(), layers=parse_layers(layers, num_layers), num_layers=num_layers,
                   hidden_size=hidden, model_id=model_id, fingerprint=fingerprint_dir(path), engine=engine,
                   layout=resolve_layout(top, engine, engine_version), engine_version=engine_version, **store)


@dataclass
class Span:
    """One request inside a packed prefill forward: rows `[start, start + length)`, `prefix` tokens already cached."""

    start: int
    length: int
    prefix: int = 0
    rid: str | None = None
    row: int = 0  # for a padded [B, S, ...] forward (transformers); packed engines leave it 0


@dataclass
class _Partial:
    """A chunked request so far: the samples its tokens still fit (many share a system prompt), its pieces."""

    candidates: list[str]
    rid: str | None
    tokens: list[int]
    pieces: list[dict[str, torch.Tensor]] = field(default_factory=list)


class Expected:
    """The announced samples, read incrementally from `requests.jsonl` and indexed by their token ids."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.samples: dict[str, tuple[list[int], list[bool]]] = {}
        self._full: dict[tuple[int, ...], list[str]] = {}
        self._head: dict[tuple[int, ...], list[str]] = {}
        self._offset = 0

    def refresh(self) -> bool:
        """Read lines appended since the last call (whole lines only); True when something new arrived."""
        try:
            if self.path.stat().st_size <= self._offset:
                return False
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                rec = json.loads(line)
                self._add(str(rec["id"]), [int(t) for t in rec["input_ids"]], [bool(m) for m in rec["loss_mask"]])
        return end > 0

    def _add(self, sample_id: str, ids: list[int], mask: list[bool]) -> None:
        if sample_id in self.samples:
            return
        self.samples[sample_id] = (ids, mask)
        self._full.setdefault(tuple(ids), []).append(sample_id)
        self._head.setdefault(tuple(ids[:HEAD]), []).append(sample_id)

    def whole(self, ids: list[int]) -> list[str]:
        """Samples whose token ids are exactly `ids`."""
        return self._full.get(tuple(ids), [])

    def continued_by(self, ids: list[int]) -> list[str]:
        """Samples longer than `ids` that start with them (a first chunk). A chunk shorter than HEAD tokens (an
        engine gives a new request whatever is left of a step's token budget) is looked up by a scan: rare."""
        pool = self._head.get(tuple(ids[:HEAD]), []) if len(ids) >= HEAD else self.samples
        return [s for s in pool if len(self.samples[s][0]) > len(ids) and self.samples[s][0][:len(ids)] == ids]


_NOT_STORED = {"input_ids", "positions"}  # recorded to identify requests; the store takes the announced ids


class Matcher:
    """Turns per-request pieces of prefill forwards into whole, identified samples (runs on the writer thread)."""

    def __init__(self, expected: Expected, emit, done: set[str]) -> None:
        self.expected = expected
        self.emit = emit
        self.done = set(done)  # emitted or already committed: a re-sent sample is a duplicate
        self.partials: list[_Partial] = []
        self.counts: Counter[str] = Counter()

    def feed(self, span: Span, tensors: dict[str, torch.Tensor]) -> None:
        ids = tensors["input_ids"].reshape(-1).tolist()
        if span.prefix == 0:
            self._start(span, ids, tensors)
        else:
            self._continue(span, ids, tensors)

    def _free(self, candidates: list[str]) -> list[str]:
        return [s for s in candidates if s not in self.done]

    def _lookup(self, ids: list[int]) -> tuple[list[str], list[str]]:
        """(samples that are exactly `ids`, samples that `ids` begin), committed ones included; a miss re-reads
        requests.jsonl once: the client may have announced the sample just now."""
        whole, first = self.expected.whole(ids), self.expected.continued_by(ids)
        if not whole and not first and self.expected.refresh():
            whole, first = self.expected.whole(ids), self.expected.continued_by(ids)
        return whole, first

    def _start(self, span: Span, ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        whole, first = self._lookup(ids)
        if self._free(whole) or (whole and not first):
            self._finish(whole, [tensors])
            return
        if not first:
            self.counts["unmatched"] += 1
            return
        # A first chunk: follow every sample it may begin, committed ones too (a re-sent sample is a duplicate
        # only once its last chunk says which sample it is).
        if len(self.partials) >= MAX_PARTIALS:
            self.partials.pop(0)
            self.counts["abandoned_partial"] += 1
        self.partials.append(_Partial(first, span.rid, list(ids), [tensors]))

    def _continue(self, span: Span, ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        for partial in self.partials:
            if len(partial.tokens) != span.prefix or (span.rid and partial.rid and partial.rid != span.rid):
                continue
            tokens = partial.tokens + ids
            fits = [s for s in partial.candidates if self.expected.samples[s][0][:len(tokens)] == tokens]
            if not fits:
                continue
            partial.tokens, partial.candidates = tokens, fits
            partial.pieces.append(tensors)
            whole = [s for s in fits if len(self.expected.samples[s][0]) == len(tokens)]
            if whole:
                self.partials.remove(partial)
                self._finish(whole, partial.pieces)
            return
        # Its first tokens were never computed in this capture: a prefix-cache hit (or a chunk of foreign traffic).
        self.counts["refused_prefix_cached"] += 1

    def _finish(self, whole: list[str], pieces: list[dict[str, torch.Tensor]]) -> None:
        """A complete request equal to the samples `whole`: store the first one not stored yet, else a duplicate."""
        free = self._free(whole)
        if free:
            self._emit(free[0], pieces)
        else:
            self.counts["duplicate"] += 1

    def _emit(self, sample_id: str, pieces: list[dict[str, torch.Tensor]]) -> None:
        ids, mask = self.expected.samples[sample_id]
        tensors = {name: torch.cat([p[name] for p in pieces]) for name in pieces[0] if name not in _NOT_STORED}
        tensors["input_ids"] = torch.tensor(ids, dtype=torch.int32)
        tensors["loss_mask"] = torch.tensor(mask, dtype=torch.bool)
        self.emit(sample_id, tensors)
        self.done.add(sample_id)
        self.counts["captured"] += 1
        if len(pieces) > 1:  # chunked prefill: this sample was computed over several forwards and stitched
            self.counts["stitched"] += 1


def is_residual_pair(output) -> bool:
    """A layer output that is `(hidden, residual)`: two floating tensors of one shape. DeepSeek's SGLang layers
    return `(hidden, topk_indices)` (integer indices, or None): that is not one, and must never be summed."""
    if not (isinstance(output, (tuple, list)) and len(output) >= 2):
        return False
    a, b = output[0], output[1]
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()
            and b.is_floating_point() and a.shape == b.shape)


UNSPLIT = -1  # Span.prefix of a forward the writer thread splits by positions


def split_by_positions(positions: list[int]) -> list[tuple[int, int, int]]:
    """(start, length, first position) of each run of consecutive positions: packed requests restart their
    positions (at 0, or at their cached prefix), so a run is one request's tokens in this forward."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i - start, positions[start]))
            start = i
    return runs


class EngineSession:
    """One capture inside an engine process: a Tap feeding a Matcher feeding a StoreWriter.

    Engine-facing calls (forward thread): `begin(spans, total)`, `record(name, tensor)`, `skip(reason)`,
    `error(exc)`. Everything heavy happens on the Tap's writer thread or the flusher thread.
    """

    def __init__(self, cfg: EngineCaptureConfig, out: Path | None = None, extra: frozenset[str] = frozenset()) -> None:
        self.cfg = cfg
        self.out = Path(out or cfg.out)
        self.layer_names = {hidden_name(k) for k in cfg.layers}
        storage = torch_dtype(cfg.dtype)
        meta = StoreMeta(model_id=cfg.model_id, model_fingerprint=cfg.fingerprint, layer_ids=list(cfg.layers),
                         hidden_size=cfg.hidden_size, hidden_dtype=cfg.dtype,
                         teacher=TeacherSpec(kind="hidden", k=0), extra={"engine": cfg.engine})
        self._lock = threading.Lock()  # the store: writer thread (add) vs flusher thread (flush)
        self.writer = StoreWriter(self.out, meta, shard_bytes=int(cfg.shard_mb * 2**20))
        self.matcher = Matcher(Expected(Path(cfg.out) / REQUESTS_NAME), self._add, self.writer.committed_ids)
        self.tap = Tap(self.layer_names | {"teacher", "input_ids"} | set(extra), sink=self._sink, storage_dtype=storage,
                       teacher=TeacherSpec(kind="hidden", k=0), hidden_size=cfg.hidden_size)
        self.skipped: Counter[str] = Counter()
        self.adapter_state: object = None  # an engine adapter's per-process hook state, if it needs one
        self._spans: dict[str, Span] = {}
        self._forwards = 0
        self._requests = 0  # prefill requests announced to the Tap (spans of captured forwards)
        self._reported = ""  # the counters as last written
        self._total = 0
        self._last_add = 0.0
        self._dirty = False
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="hstap-engine-flush", daemon=True)
        self._flusher.start()

    # ---- forward thread -----------------------------------------------------------------------------------

    def begin(self, spans: list[Span], total: int = 0) -> None:
        """Announce a prefill forward of `total` packed rows (0 for a padded layout); `spans` are the requests
        worth keeping."""
        if self.tap.active():
            self.tap.end()  # the previous forward never produced every tensor: the Tap counts it
        self._forwards += 1
        if len(self._spans) > 4096:  # layouts of forwards the Tap dropped are never consumed: forget old ones
            for key in list(self._spans):
                if int(key.split(":", 1)[0]) < self._forwards - 64:
                    self._spans.pop(key, None)
        self._requests += len(spans)
        ids = [f"{self._forwards}:{i}" for i in range(len(spans))]
        for sid, span in zip(ids, spans):
            self._spans[sid] = span
        self._total = total
        self.tap.begin(Batch(ids=ids, rows=[s.row for s in spans], starts=[s.start for s in spans],
                             lengths=[s.length for s in spans]))

    def begin_unsplit(self, start: int, total: int) -> None:
        """A forward whose request boundaries the host cannot see (vLLM): rows `[start, total)` are kept whole
        and the writer thread splits them by the recorded `positions`."""
        self.begin([Span(start=start, length=total - start, prefix=UNSPLIT)], total)

    def active(self) -> bool:
        return self.tap.active()

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Hand one packed `[T, H]` (or `[T]`) tensor to the Tap; rows past the real tokens are padding."""
        if tensor.shape[0] < self._total:
            # An out-of-range gather on CUDA is a device-side assert that kills the engine: check on the host.
            self.error(RuntimeError(f"{name} has {tensor.shape[0]} rows for a forward of {self._total} tokens: "
                                    "the residual is sliced across ranks (attention-TP scatter or context "
                                    "parallel); capture needs the full rows on the writer rank"))
            self.tap.end()
            return
        self.tap.record(name, tensor)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def error(self, exc: BaseException) -> None:
        report = self.tap.report
        report.errors += 1
        report.first_error = report.first_error or f"{type(exc).__name__}: {exc}"

    # ---- writer / flusher threads -------------------------------------------------------------------------

    def _sink(self, sid: str, tensors: dict[str, torch.Tensor]) -> None:
        span = self._spans.pop(sid)  # KeyError only if 64 newer forwards ran first: the Tap counts it
        if span.prefix != UNSPLIT:
            self.matcher.feed(span, tensors)
            return
        for start, n, prefix in split_by_positions(tensors.pop("positions").tolist()):
            if n == 1 and prefix > 0:
                self.skipped["decode_rows"] += 1  # a decode token riding in a mixed batch
                continue
            self.matcher.feed(Span(start=start, length=n, prefix=prefix),
                              {name: t[start:start + n] for name, t in tensors.items()})

    def _add(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.writer.add(sample_id, tensors)
            self._last_add = time.monotonic()
            self._dirty = True

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.cfg.flush_s):
            if self._dirty and time.monotonic() - self._last_add >= self.cfg.flush_s:
                self.flush()
            elif json.dumps(self.report()) != self._reported:
                self.write_report()

    def flush(self) -> None:
        """Commit what is buffered and write the counters (safe from any thread)."""
        try:
            with self._lock:
                self.writer.flush()
                self._dirty = False
            self.write_report()
        except Exception as exc:  # noqa: BLE001 — a full disk must not kill the engine's process
            self.error(exc)

    def report(self) -> dict:
        tap = self.tap.report
        return {"forwards": self._forwards, "prefill_requests": self._requests, **dict(self.matcher.counts),
                "skipped": dict(self.skipped),
                "errors": tap.errors, "dropped_samples": tap.dropped_samples, "first_error": tap.first_error,
                "open_partials": len(self.matcher.partials), "pid": os.getpid()}

    def write_report(self) -> None:
        report = self.report()
        self._reported = json.dumps(report)
        tmp = self.out / (REPORT_NAME + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, self.out / REPORT_NAME)

    def close(self) -> dict:
        """Drain the Tap, commit the store, stop the flusher; returns the counters."""
        if self._closed.is_set():
            return self.report()
        self.tap.close()
        self._closed.set()
        self._flusher.join(timeout=10)
        with self._lock:
            self.writer.close()
        self.write_report()
        report = self.report()
        if report["prefill_requests"] and not report.get("captured"):
            print(f"hstap capture: {report['prefill_requests']} prefill requests seen, 0 captured into {self.out} "
                  f"(unmatched {report.get('unmatched', 0)}, refused_prefix_cached "
                  f"{report.get('refused_prefix_cached', 0)}, errors {report['errors']}: {report['first_error']})",
                  file=sys.stderr, flush=True)
        return report


_SESSIONS: dict[str, EngineSession] = {}
_SESSIONS_LOCK = threading.Lock()


def session_for(cfg: EngineCaptureConfig, out: Path | None = None,
                extra: frozenset[str] = frozenset()) -> EngineSession:
    """The process's session for this store (every hook spec of one capture shares it); closed at exit."""
    key = str(Path(out or cfg.out).resolve())
    with _SESSIONS_LOCK:
        if key not in _SESSIONS:
            if not _SESSIONS:
                atexit.register(close_sessions)
            _SESSIONS[key] = EngineSession(cfg, out, extra)
        return _SESSIONS[key]


def close_sessions() -> dict[str, dict]:
    """Close every session of this process (atexit, `remove_taps`, tests)."""
    with _SESSIONS_LOCK:
        sessions = dict(_SESSIONS)
        _SESSIONS.clear()
    return {key: s.close() for key, s in sessions.items()}
