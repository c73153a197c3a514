"""`hstap capture-remote`: prefill conversations through a tapped server (SGLang, vLLM, `hstap serve --engine hf`).

    hstap capture-remote --url http://127.0.0.1:30000 --data jsonl:synth.jsonl --capture-dir runs/sg \\
        [--model smollm2] [--max-tokens 2048] [--concurrency 8] [--timeout 600]

The engine process writes the store (its taps were configured at launch with the same `--capture-dir`); this
client only decides what gets prefilled:
0. probes the server (`GET /v1/models`, as `hstap synth --server` does): a server that accepts connections and
   never answers ends the run within `--timeout` (30 s at most) in one line, instead of each request's timeout;
1. renders every conversation exactly as `hstap capture` does (same tokens, same assistant-only loss mask);
2. announces the samples not yet in the store by appending `{"id", "input_ids", "loss_mask"}` lines to
   `DIR/requests.jsonl`, fsynced *before* any request is sent: the engine identifies a prefill by its token ids
   against this file (engines carry no conversation ids, and warmup or health probes then match nothing);
3. sends each as `POST /v1/completions {"prompt": [token ids], "max_tokens": 1}` — the OpenAI shape SGLang, vLLM
   and the hf engine all accept — with bounded concurrency and per-request timeouts; a request the server did not
   take (refused or reset connection, connect timeout, HTTP 502/503/504) is tried `--retries` times in all, with
   backoff; a server that answered none of them is given up on at once, in one line naming the URL: no waiting;
4. waits until the store's manifest lists every id — bounded by `--timeout`, and given up after `--settle` seconds
   without a new sample — then prints the engine's counters. A server that answered every prefill while the engine
   stored none of them (taps that never fired: a module name the served model does not have) is an error, in
   one line, not an empty store.
Re-running resumes: samples already in the store are neither announced nor sent again. Records of `--data` that
were not sent (malformed, too long) are counted and the first is named: `skipped N records (…; first: F:line: …)`.

`--vllm-route extract` (a vLLM server started by `hstap serve --vllm-route extract`): the engine writes one file per
request instead of a store, and this client converts each answer's file into the store itself
(hstap.capture.vllm_extract); nothing is announced.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hstap.capture.config import RemoteCaptureConfig
from hstap.capture.engine_session import REPORT_NAME, REQUESTS_NAME
from hstap.errors import HstapError


@dataclass
class RemoteResult:
    sent: int
    already: int
    stored: int
    missing: list[str]
    failed: list[str]
    engine: dict
    skipped: str = ""  # SkipReport.skipped_line(): records of --data that were not sent, counted, the first named

    def summary(self) -> str:
        lines = [f"capture-remote: sent {self.sent} samples ({self.already} already in the store); "
                 f"{self.stored} stored"]
        if self.skipped:
            lines.append(f"  {self.skipped}")
        if self.failed:
            lines.append(f"  {len(self.failed)} requests failed (first: {self.failed[0]})")
        if self.missing:
            lines.append(f"  {len(self.missing)} never reached the store (first: {self.missing[0]!r}); see the "
                         f"engine counters below")
        if self.engine:
            lines.append(f"  engine: {json.dumps(self.engine, sort_keys=True)}")
        return "\n".join(lines)


def _stored_ids(capture_dir: Path) -> set[str]:
    from hstap.store import load_manifest

    path = capture_dir / "manifest.json"
    if not path.exists():
        return set()
    return {e.id for s in load_manifest(path).shards for e in s.samples}


def announce(capture_dir: Path, samples) -> None:
    """Append the samples to `requests.jsonl` and fsync, so the engine knows them before it sees them.

    Under an exclusive lock, in one write: two clients never interleave bytes. A line a killed client left without
    its newline is cut first (engines read whole lines only, so none has seen it; its sample is announced again)."""
    try:
        capture_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(capture_dir / REQUESTS_NAME, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise HstapError(f"--capture-dir {capture_dir}: cannot write {REQUESTS_NAME} ({e.strerror})") from None
    payload = "".join(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n"
                      for s in samples).encode()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _cut_partial_line(fd)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock


def _cut_partial_line(fd: int, chunk: int = 1 << 16) -> None:
    end = os.lseek(fd, 0, os.SEEK_END)
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        data = os.pread(fd, pos - start, start)
        if pos == end and data.endswith(b"\n"):
            return
        newline = data.rfind(b"\n")
        if newline >= 0:
            os.ftruncate(fd, start + newline + 1)
            return
        pos = start
    if end:
        os.ftruncate(fd, 0)


RETRY_STATUS = {502, 503, 504}  # a proxy or a server that is not taking requests (yet): worth another try
BACKOFF_S = 0.5  # before the 2nd attempt; doubled for each next one


def _not_taken() -> tuple[type, ...]:
    """httpx errors after which the server cannot have processed the request: safe and useful to retry."""
    import httpx

    return (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class _Sender:
    """Sends prefills, retrying what the server did not take; once every attempt of some request failed to reach a
    server that has answered nothing yet, the URL is dead and the requests still to go are not tried."""

    def __init__(self, client, url: str, model: str | None, retries: int, on_answer=None) -> None:
        self.client, self.url, self.model, self.retries = client, url, model, retries
        self.on_answer = on_answer  # (sample, 200 response) -> None or why it failed: vLLM's extract route
        self.not_taken = _not_taken()
        self.answered = threading.Event()
        self.dead = threading.Event()

    def send(self, sample) -> str | None:
        body = {"prompt": sample.input_ids, "max_tokens": 1, "temperature": 0}
        if self.model:
            body["model"] = self.model
        why = ""
        for attempt in range(self.retries):
            if self.dead.is_set():
                return f"{sample.id}: not sent ({self.url} is unreachable)"
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                r = self.client.post(f"{self.url}/v1/completions", json=body)
            except Exception as exc:  # noqa: BLE001 — reported per sample, never fatal for the others
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                if isinstance(exc, self.not_taken):
                    continue
                break  # a read timeout: the server took the request; sending it again would not help
            self.answered.set()
            if r.status_code in RETRY_STATUS:
                why = f"HTTP {r.status_code} {' '.join(r.text.split())[:200]}"
                continue
            if r.status_code != 200:
                return f"{sample.id}: HTTP {r.status_code} {r.text[:200]}"
            return self.on_answer(sample, r) if self.on_answer else None
        if not self.answered.is_set():
            self.dead.set()
        return f"{sample.id}: {why} (after {self.retries} attempts)"


PROBE_S = 30.0  # the longest the first GET /v1/models may take (less with a shorter --timeout): it is answered at once


def _probe(url: str, cfg: RemoteCaptureConfig) -> None:
    """The server answers HTTP at `url` (`hstap synth --server`'s /v1/models check), before anything is rendered or
    announced: a server that accepts connections and never answers ends the run within --timeout, in one line."""
    from hstap.synth.server import probe_server

    try:
        probe_server(url, timeout=min(cfg.timeout, PROBE_S), retries=cfg.retries, backoff=BACKOFF_S)
    except HstapError as exc:
        raise HstapError(f"capture-remote: {exc} (`hstap serve` prints 'ready on URL')") from None


def run_remote(cfg: RemoteCaptureConfig) -> RemoteResult:
    """Announce, send and wait; see the module docstring (`--vllm-route extract`: hstap.capture.vllm_extract)."""
    import httpx

    from hstap.capture.vllm_extract import PLAN_NAME, ExtractCollector
    from hstap.data import SkipReport, render_all
    from hstap.models import load_tokenizer

    url, data, capture_dir, timeout = cfg.url, cfg.data, cfg.capture_dir, cfg.timeout
    if cfg.vllm_route == "extension" and (capture_dir / PLAN_NAME).exists():
        raise HstapError(f"--capture-dir {capture_dir} belongs to a vLLM server of the extract route "
                         f"({PLAN_NAME}): pass --vllm-route extract")
    extract = ExtractCollector.open(capture_dir, cfg.settle) if cfg.vllm_route == "extract" else None
    try:
        _probe(url, cfg)
        skips = SkipReport()
        samples = render_all(data, load_tokenizer(cfg.model), skips, max_tokens=cfg.max_tokens,
                             limit=cfg.limit, loops=cfg.loops)
        if not samples:
            raise HstapError(f"--data {data}: no usable conversations ({skips.summary()})")
        done = extract.writer.committed_ids if extract else _stored_ids(capture_dir)
        todo = [s for s in samples if s.id not in done]
        if extract is None:
            announce(capture_dir, todo)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=httpx.Timeout(min(timeout, 300.0), connect=10.0)) as client, \
                ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
            sender = _Sender(client, url.rstrip("/"), cfg.served_model, cfg.retries,
                             on_answer=extract.on_answer if extract else None)
            failed = [e for e in pool.map(sender.send, todo) if e]
    finally:
        if extract is not None:
            extract.writer.close()  # commits what was converted, whatever happened
    if todo and not sender.answered.is_set():
        why = next(f for f in failed if "not sent" not in f).split(": ", 1)[1]
        raise HstapError(f"capture-remote: {url} did not answer any of {len(todo)} prefill requests ({why}); is the "
                         "server up on that URL? (`hstap serve` prints 'ready on URL')")
    want = {s.id for s in samples}
    if extract is not None:  # this client wrote the store itself: nothing to wait for
        if todo and not extract.counts["captured"]:
            raise HstapError(f"capture-remote: {len(todo)} prefills answered, none stored in {capture_dir} "
                             f"({dict(extract.counts)}; first: {failed[0] if failed else 'none'})")
        stored = _stored_ids(capture_dir)
        return RemoteResult(sent=len(todo), already=len(samples) - len(todo), stored=len(want & stored),
                            missing=sorted(want - stored), failed=failed, engine={"route": "extract", **extract.counts},
                            skipped=skips.skipped_line())
    stored, progress = _stored_ids(capture_dir), time.monotonic()
    while not want <= stored and time.monotonic() < deadline:  # the engine commits after a short idle
        time.sleep(0.2)
        now = _stored_ids(capture_dir)
        if now != stored:
            stored, progress = now, time.monotonic()
        elif time.monotonic() - progress > cfg.settle:
            break
    report = capture_dir / REPORT_NAME
    engine = json.loads(report.read_text()) if report.exists() else {}
    answered = len(todo) - len(failed)
    if answered and not {s.id for s in todo} & stored:
        counters = json.dumps(engine, sort_keys=True) if engine else "none written: no tap ever ran"
        raise HstapError(f"capture-remote: the server answered {answered} prefill requests but the engine stored none "
                         f"of them in {capture_dir} after {cfg.settle:.0f} s (engine counters: {counters}); check the "
                         "engine log for 'No modules matched' and that it was launched with this --capture-dir")
    return RemoteResult(sent=len(todo), already=len(samples) - len(todo), stored=len(want & stored),
                        missing=sorted(want - stored), failed=failed, engine=engine, skipped=skips.skipped_line())
