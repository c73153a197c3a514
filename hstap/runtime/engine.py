"""The batched Engine: requests from any thread, decoded in batches on one worker thread over the runtime.

    from hstap.runtime.engine import Engine, Request
    engine = Engine(target, max_batch=16)                      # CUDA graphs on a GPU, the same code eagerly on a CPU;
                                                               # on a CPU rows refilled as requests finish (continuous)
    gens = engine.generate([Request(prompt=ids, max_new_tokens=128)])
    gens[0].tokens, gens[0].finish_reason                      # generated ids (stop token excluded), "stop" | "length"
    engine = Engine(target, drafter=d, draft="chain:3")        # speculative decoding; engine.spec_stats() for τ
    engine.submit(request, on_tokens=send)                     # send(new_ids) as they are decoded; False stops it
    engine.close()

Synth (`hstap.synth.embedded.EmbeddedBackend`) and the `hf` server (`hstap.serve.hf_server`) both use it. Targets
the lean forward does not run (not Llama-family) decode on transformers' DynamicCache (`EagerStepper`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hstap.errors import HstapError
from hstap.metrics import acceptance_length
from hstap.models.target import stop_ids
from hstap.runtime.decode import EagerStepper, Generation, Request, Stepper, decode
from hstap.runtime.llama import unsupported
from hstap.runtime.stream import Session
from hstap.runtime.target import Runtime

if TYPE_CHECKING:
    from hstap.runtime.spec import SpecDecoder


class OverPositions(HstapError):
    """A request whose prompt plus max_new_tokens exceeds the model's positions. The Engine is the one place this
    is checked (at `submit`): the same request fails the same way every time, so synth files it as never to retry
    and the `hf` server answers 400 context_length_exceeded."""


@dataclass
class _Job:
    request: Request
    future: Future
    on_tokens: Callable[[list[int]], bool] | None = None
    sent: int = 0  # tokens already handed to on_tokens
    ended: bool = False  # on_tokens returned False: nobody wants the rest


class Engine:
    """Batches requests from any thread onto one decode worker thread.

    `submit` returns a Future. With `continuous` (the default for plain decoding on hstap's runtime on a CPU) the
    worker keeps up to `max_batch` requests decoding and refills a row as soon as its request finishes
    (hstap.runtime.stream): a request that arrives mid-batch starts within `sync_every` steps instead of after the
    batch's longest row. On CUDA the default is static batches, which answered ShareGPT faster than refilled rows at
    synth's batch of 256 (bench/continuous.py, docs/benchmarks.md); on a CPU refilling was the faster. Otherwise (a
    drafter, a target the runtime does not run, `continuous=False`, CUDA unless `continuous=True`) it takes up to
    `max_batch` waiting requests (oldest first) as one batch that runs to its end. A batch (a continuous session) is
    seeded by its first request's `seed` (else by a counter from `seed`), so sampled output is reproducible for the
    same batches; `generate_batch` fixes the batch. It decodes on the runtime's static caches, replaying CUDA graphs
    on CUDA (`cuda_graphs`); `compile_step` also runs the forward through torch.compile (faster, a compile per
    shape, bf16 rounding that differs slightly from the eager kernels). With a `drafter` (or `draft="ngram:K"`)
    every batch is decoded speculatively with that draft shape: greedy requests get the same tokens as without it.
    `prefill` is the runtime's prefill path (`Runtime`): "lean" (default), or "model" when hooks on the
    transformers model must see the prompts (the `hf` engine's capture taps, `hstap.serve.hf_capture`).
    """

    def __init__(self, target, max_batch: int = 16, cuda_graphs: bool | None = None, max_len: int | None = None,
                 seed: int = 0, compile_step: bool = False, drafter=None, draft: str | None = None,
                 continuous: bool | None = None, prefill: str = "lean"):
        if max_batch < 1:
            raise HstapError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.max_batch = target.model, target.tokenizer, max_batch
        self.device = next(self.model.parameters()).device
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = stop_ids(self.model, self.tokenizer)
        self._stops = set(self.stop_ids)
        self.max_len = max_len or int(getattr(self.model.config, "max_position_embeddings", 8192))
        self.stepper = self._make_stepper(cuda_graphs, compile_step, prefill)
        self.spec = self._make_spec(drafter, draft)
        self._spec_totals = {"verify_forwards": 0, "emitted": 0, "accepted": 0}
        self._batching = {"active": 0, "max_rows": 0, "ended_early": 0}
        self._session: Session | None = None  # the continuous session decoding now
        self._listening: list[_Job] | None = None  # the speculative batch's jobs, row by row
        self.sync_every = 8 if self.device.type == "cuda" else 1
        self._seed = seed
        can_stream = self.spec is None and isinstance(self.stepper, Runtime)
        if continuous and not can_stream:
            raise HstapError("continuous batching runs plain decoding on hstap's runtime (Llama-family targets, no "
                             "drafter)")
        self.continuous = (can_stream and self.device.type != "cuda") if continuous is None else continuous
        self._decoding = threading.Lock()  # the stepper's cache serves one batch at a time
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        serve = self._serve_continuous if self.continuous else self._serve
        self._worker = threading.Thread(target=serve, name="hstap-engine", daemon=True)
        self._worker.start()

    def _make_stepper(self, cuda_graphs: bool | None, compile_step: bool, prefill: str) -> Stepper:
        if unsupported(self.model) is not None:
            return EagerStepper(self.model)  # transformers' forward throughout: hooks see every prefill anyway
        return Runtime(self.model, batch_size=self.max_batch, max_len=self.max_len, cuda_graphs=cuda_graphs,
                       compile_step=compile_step, prefill=prefill)

    def _make_spec(self, drafter, draft: str | None):
        """The speculative decoder of `draft` (default chain:3 with a drafter), or None."""
        from hstap.runtime.shapes import DraftShape
        from hstap.runtime.spec import SpecDecoder

        if drafter is None and draft is None:
            return None
        if not hasattr(self.stepper, "lean"):
            raise HstapError(f"speculative decoding runs on Llama-family targets only: {unsupported(self.model)}")
        spec = SpecDecoder(self.stepper, DraftShape.parse(draft or "chain:3"), drafter)
        self._stream_verifications(spec)
        return spec

    def _stream_verifications(self, spec: SpecDecoder) -> None:
        """Hand each verification's tokens to their listeners as the host reads them. A row whose listener is
        gone, or that reached its own max_new_tokens (the batch decodes to its longest), is marked done, so the
        batch no longer waits for it."""

        def stream(results: list) -> None:
            for job, row in zip(self._listening or (), results):
                if not row.done and (not self._progress(job, row.tokens)
                                     or len(row.tokens) >= job.request.max_new_tokens):
                    row.done = True

        spec.on_cycle = stream

    def spec_stats(self) -> dict:
        """Speculative decoding so far: verification forwards, tokens they produced (bonus included), draft
        tokens accepted, and τ = tokens per verification forward (None before the first)."""
        totals = dict(self._spec_totals)
        forwards = totals["verify_forwards"]
        totals["tau"] = acceptance_length(totals["emitted"], forwards) if forwards else None
        totals["draft"] = self.spec.shape.spec if self.spec is not None else None
        return totals

    def submit(self, request: Request, on_tokens: Callable[[list[int]], bool] | None = None) -> Future:
        """Queue one request; the Future resolves to its Generation (or raises what decoding raised).

        `on_tokens(new_ids)`, called on the worker thread, gets the request's tokens as they are decoded, cut as
        its Generation will be, always before the Future resolves: at every host read on continuous rows, at
        every verification with a drafter, all at once when a static batch ends. Returning False (or raising)
        says nobody wants the rest: a continuous row is freed at once, a speculative row marked done (its batch
        no longer waits for it), and the Future resolves to the tokens so far."""
        self._check(request)
        future: Future = Future()
        self._jobs.put(_Job(request, future, on_tokens))
        return future

    def batch_stats(self) -> dict:
        """Requests the worker holds now (`active`: decoding or waiting for a row), the most decoded together so
        far (`max_rows`), and how many ended early because their listener stopped them (`ended_early`)."""
        stats = dict(self._batching)
        session = self._session
        if session is not None:
            stats["max_rows"] = max(stats["max_rows"], session.peak)
        return stats

    @property
    def closed(self) -> bool:
        """True once `close` was called: `submit` refuses new requests."""
        return self._closed

    def _check(self, request: Request) -> None:
        if self._closed:
            raise HstapError("engine is closed")
        if not request.prompt:
            raise HstapError("empty prompt: nothing to answer")
        prompt, limit = len(request.prompt), self.max_len
        if prompt + request.max_new_tokens > limit:
            fix = f"max_new_tokens {limit - prompt} would fit" if prompt < limit else "shorten the prompt"
            raise OverPositions(f"prompt of {prompt} tokens + max_new_tokens {request.max_new_tokens} exceeds the "
                                f"model's {limit} positions: {fix}")

    def generate(self, requests: list[Request], timeout: float | None = None) -> list[Generation]:
        """Submit all and wait: convenient for callers that already hold a list."""
        futures = [self.submit(r) for r in requests]
        return [f.result(timeout=timeout) for f in futures]

    def generate_batch(self, requests: list[Request]) -> list[Generation]:
        """Decode exactly `requests` as one batch, on the caller's thread, seeded by the first request's seed.

        `generate` lets the worker batch whatever is waiting, so which rows share a batch (and so the sampled
        tokens) depends on thread timing; here the batch is fixed, so sampled output is reproducible."""
        if not 0 < len(requests) <= self.max_batch:
            raise HstapError(f"generate_batch takes 1 to max_batch={self.max_batch} requests, got {len(requests)}")
        for request in requests:
            self._check(request)
        return self._decode(requests)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the batch in progress, fail the waiting requests, stop the worker."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=timeout)

    def _take_batch(self) -> list[_Job] | None:
        first = self._jobs.get()
        if first is None:
            return None
        batch = [first]
        while len(batch) < self.max_batch:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # close() was called: answer what we hold, then stop
                self._jobs.put(None)
                break
            batch.append(job)
        return batch

    def _serve(self) -> None:
        while (batch := self._take_batch()) is not None:
            batch = [j for j in batch if self._started(j)]
            if not batch:
                continue
            self._batching["max_rows"] = max(self._batching["max_rows"], len(batch))
            try:
                gens = self._decode([j.request for j in batch], batch)
            except Exception as exc:  # a failed batch fails its requests, never the worker
                for job in batch:
                    self._fail(job, exc)
                continue
            for job, gen in zip(batch, gens):
                self._finish(job, gen)
        self._fail_queued()

    def _started(self, job: _Job) -> bool:
        """Take a queued job for decoding; False when it was cancelled while it waited."""
        if not job.future.set_running_or_notify_cancel():
            return False
        self._batching["active"] += 1
        return True

    def _progress(self, job: _Job, tokens: list[int]) -> bool:
        """Hand a row's new tokens (all it has so far, cut as its Generation will be) to the job's listener;
        False once the listener wants no more."""
        if job.on_tokens is None or job.ended:
            return not job.ended
        new = tokens[job.sent:job.request.max_new_tokens]
        end = next((k for k, tok in enumerate(new) if tok in self._stops), len(new))  # the stop id is not sent
        new = new[:end]
        job.sent += len(new)
        if not new:
            return True
        try:
            keep = job.on_tokens(new)
        except Exception:  # noqa: BLE001 -- a broken listener must not fail its batch's other rows: it counts as gone
            keep = False
        if not keep:
            job.ended = True
            self._batching["ended_early"] += 1
        return keep

    def _finish(self, job: _Job, gen: Generation) -> None:
        """The last tokens to the listener, then the Future (a listener never sees tokens after the result)."""
        self._progress(job, gen.tokens)
        self._batching["active"] -= 1
        job.future.set_result(gen)

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._batching["active"] -= 1
        job.future.set_exception(exc)

    def _fail_queued(self) -> None:
        while True:  # closed: whatever is still queued will never run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(HstapError("engine closed before this request ran"))

    def _serve_continuous(self) -> None:
        """Continuous batching (hstap.runtime.stream): a session's rows are refilled from the queue as requests
        finish; a new session starts when the next request needs a longer cache than the last one had."""
        waiting: deque[tuple[_Job, Request]] = deque()
        accepting = True

        def take(job: _Job | None) -> None:
            nonlocal accepting
            if job is None:  # close(): finish the rows in progress, fail what waits
                accepting = False
            elif self._started(job):
                waiting.append((job, job.request))

        def poll() -> bool:
            while accepting:
                try:
                    take(self._jobs.get_nowait())
                except queue.Empty:
                    break
            return accepting

        while accepting or waiting:
            if not waiting:
                take(self._jobs.get())
                continue
            seed = waiting[0][1].seed
            if seed is None:
                seed, self._seed = self._seed, self._seed + 1
            session = self._session = Session(self.stepper, self.pad_id, self.stop_ids, self.sync_every, seed)
            with self._decoding:
                session.run(waiting, poll, self._finish, self._fail, self._progress)
            self._batching["max_rows"] = max(self._batching["max_rows"], session.peak)
            self._session = None
            if not accepting:
                for job, _ in waiting:
                    self._fail(job, HstapError("engine closed before this request ran"))
                waiting.clear()
        self._fail_queued()

    def _decode(self, requests: list[Request], jobs: list[_Job] | None = None) -> list[Generation]:
        """One static batch; `jobs` (row by row, from the worker) get their tokens per verification."""
        with self._decoding:
            return self._decode_unlocked(requests, jobs)

    def _decode_unlocked(self, requests: list[Request], jobs: list[_Job] | None) -> list[Generation]:
        longest = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
        if longest > self.max_len and len(requests) > 1:  # each fits alone (submit checked): split the batch
            half = len(requests) // 2
            return (self._decode_unlocked(requests[:half], jobs and jobs[:half])
                    + self._decode_unlocked(requests[half:], jobs and jobs[half:]))
        seed = requests[0].seed
        if seed is None:
            seed, self._seed = self._seed, self._seed + 1
        generator = None
        if any(r.temperature > 0 for r in requests):
            generator = torch.Generator(device=self.device).manual_seed(seed)
        with torch.inference_mode():
            if self.spec is not None:
                return self._speculate(requests, generator, jobs)
            return decode(self.stepper, requests, self.pad_id, self.stop_ids, self.device, generator, self.sync_every)

    def _speculate(self, requests: list[Request], generator: torch.Generator | None,
                   jobs: list[_Job] | None = None) -> list[Generation]:
        """One batch through the speculative decoder, cut per row at its own max_new_tokens and first stop."""
        stops = self._stops
        self._listening = jobs
        try:
            rows = self.spec.generate([r.prompt for r in requests], max(r.max_new_tokens for r in requests), stops,
                                      self.pad_id, [r.temperature for r in requests], [r.top_p for r in requests],
                                      generator)
        finally:
            self._listening = None
        gens = []
        for req, row in zip(requests, rows):
            tokens = row.tokens[: req.max_new_tokens]
            end = next((k for k, tok in enumerate(tokens) if tok in stops), None)
            gens.append(Generation(tokens=tokens if end is None else tokens[:end],
                                   finish_reason="length" if end is None else "stop",
                                   prompt_tokens=len(req.prompt), stop_token=None if end is None else tokens[end]))
            self._spec_totals["verify_forwards"] += len(row.accepted)
            self._spec_totals["emitted"] += sum(row.emitted)
            self._spec_totals["accepted"] += sum(row.accepted)
        return gens
