"""Batched generation with the embedded target: left padding, a KV cache, per-row stops, greedy or top-p sampling.

    from hstap.synth.embedded import Engine, Request
    engine = Engine(target, max_batch=16)         # CUDA graphs on a GPU, the plain eager loop on a CPU
    gens = engine.generate([Request(prompt=ids, max_new_tokens=128)])
    gens[0].tokens, gens[0].finish_reason         # generated ids (stop token excluded), "stop" | "length"
    engine.close()

`decode(stepper, requests, ...)` is the one decode loop. A stepper owns the KV cache and runs the forward:
`EagerStepper` (transformers' DynamicCache, exactly what `generate` feeds the model) or `StaticStepper`
(hstap/synth/static.py: a preallocated cache and, on CUDA, one captured graph per batch shape). `Engine` runs
decode on a worker thread and batches whatever requests are waiting, so a synth run and the `hf` server share it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from hstap.errors import HstapError
from hstap.models.target import stop_ids
from hstap.synth.static import StaticStepper, left_pad, positions_from_mask


@dataclass(frozen=True)
class Request:
    """One prompt to answer. temperature 0 = greedy; `seed` seeds the batch it lands in (see Engine)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    """What the target produced for one request; `tokens` excludes the stop token that ended it."""

    tokens: list[int]
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        """Tokens the target generated, the stop token included (what OpenAI-compatible servers report)."""
        return len(self.tokens) + (self.finish_reason == "stop")


class Stepper(Protocol):
    """Runs the target over a left-padded batch, keeping the KV cache between calls."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """ids, mask: [B, P] (left padded) -> next-token logits [B, V] fp32."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B] just picked -> next-token logits [B, V] fp32."""
        ...


class EagerStepper:
    """transformers' DynamicCache with a growing 2D mask: the same forward inputs `model.generate` builds."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.mask = mask
        positions = positions_from_mask(mask)  # [B, P]
        self.next_pos = positions[:, -1:] + 1  # [B, 1]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)  # [B, P+t+1]
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_pos,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()


def pick_next(logits: torch.Tensor, temperature: torch.Tensor | None, top_p: torch.Tensor | None,
              generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row: argmax where temperature is 0 (or None: all greedy), else a top-p sample.

    logits [B, V] fp32, temperature [B], top_p [B] -> [B] long. The greedy branch is exactly `generate`'s.
    """
    greedy = logits.argmax(dim=-1)  # [B]
    if temperature is None:
        return greedy
    sampled = temperature > 0  # [B]
    scaled = logits / temperature.clamp_min(1e-5)[:, None]  # [B, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))  # keeps >= 1 token
    choice = torch.multinomial(sorted_logits.softmax(dim=-1), 1, generator=generator)  # [B, 1]
    return torch.where(sampled, order.gather(-1, choice)[:, 0], greedy)


def decode(stepper: Stepper, requests: list[Request], pad_id: int, stop_ids: list[int], device: torch.device | str,
           generator: torch.Generator | None = None, sync_every: int = 1) -> list[Generation]:
    """Answer `requests` as one left-padded batch; every row stops at a stop id or its own max_new_tokens.

    Rows that are done keep receiving the pad token (their output is ignored), like `generate`. The loop ends
    when all rows are done; it checks that every `sync_every` steps (a host sync: keep it rare on a GPU).
    """
    assert requests and all(r.prompt for r in requests), "decode needs at least one non-empty prompt"
    ids, mask = left_pad([r.prompt for r in requests], pad_id, device)
    steps = max(r.max_new_tokens for r in requests)
    limit = torch.tensor([r.max_new_tokens for r in requests], device=device)  # [B]
    temperature = top_p = None  # all greedy: no sampling work, no host sync to find out per step
    if any(r.temperature > 0 for r in requests):
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    out = torch.full((len(requests), steps), pad_id, dtype=torch.long, device=device)  # [B, T]
    done = limit <= 0  # [B]
    logits = stepper.prefill(ids, mask, steps)
    for t in range(steps):
        tokens = pick_next(logits, temperature, top_p, generator).masked_fill(done, pad_id)  # [B]
        out[:, t] = tokens
        done = done | torch.isin(tokens, stops) | (limit <= t + 1)
        if t + 1 == steps or ((t + 1) % sync_every == 0 and bool(done.all())):
            break
        logits = stepper.step(tokens)
    return _finish(out.cpu().tolist(), requests, set(stop_ids))


def _finish(rows: list[list[int]], requests: list[Request], stops: set[int]) -> list[Generation]:
    gens = []
    for row, req in zip(rows, requests):
        row = row[:req.max_new_tokens]
        end = next((k for k, tok in enumerate(row) if tok in stops), None)
        reason = "length" if end is None else "stop"
        gens.append(Generation(tokens=row if end is None else row[:end], finish_reason=reason,
                               prompt_tokens=len(req.prompt)))
    return gens


@dataclass
class _Job:
    request: Request
    future: Future


class Engine:
    """Batches requests from any thread onto one decode worker thread.

    `submit` returns a Future; the worker takes up to `max_batch` waiting requests (oldest first) as one batch.
    A batch is seeded by its first request's `seed` (else by a counter from `seed`), so sampled output is
    reproducible for the same batches. On CUDA it decodes with static caches and CUDA graphs (`cuda_graphs`);
    `compile_step` also runs the decode step through torch.compile (faster, ~1 min to compile per batch shape,
    and bf16 rounding that differs slightly from the eager kernels).
    """

    def __init__(self, target, max_batch: int = 16, cuda_graphs: bool | None = None, max_len: int | None = None,
                 seed: int = 0, compile_step: bool = False):
        if max_batch < 1:
            raise HstapError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.max_batch = target.model, target.tokenizer, max_batch
        self.device = next(self.model.parameters()).device
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = stop_ids(self.model, self.tokenizer)
        self.max_len = max_len or int(getattr(self.model.config, "max_position_embeddings", 8192))
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.stepper = self._make_stepper(use_graphs, compile_step)
        self.sync_every = 8 if self.device.type == "cuda" else 1
        self._seed = seed
        self._decoding = threading.Lock()  # the stepper's cache serves one batch at a time
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="hstap-engine", daemon=True)
        self._worker.start()

    def _make_stepper(self, use_graphs: bool, compile_step: bool) -> Stepper:
        if not (use_graphs or compile_step):
            return EagerStepper(self.model)

        return StaticStepper(self.model, batch_size=self.max_batch, max_len=self.max_len, pad_id=self.pad_id,
                             cuda_graphs=use_graphs and self.device.type == "cuda", compile_step=compile_step)

    def submit(self, request: Request) -> Future:
        """Queue one request; the Future resolves to its Generation (or raises what decoding raised)."""
        self._check(request)
        future: Future = Future()
        self._jobs.put(_Job(request, future))
        return future

    def _check(self, request: Request) -> None:
        if self._closed:
            raise HstapError("engine is closed")
        if not request.prompt:
            raise HstapError("empty prompt: nothing to answer")
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise HstapError(f"prompt of {len(request.prompt)} tokens + max_new_tokens {request.max_new_tokens} "
                             f"exceeds the model's {self.max_len} positions: lower max_new_tokens or the prompt")

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
            batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                gens = self._decode([j.request for j in batch])
            except Exception as exc:  # a failed batch fails its requests, never the worker
                for job in batch:
                    job.future.set_exception(exc)
                continue
            for job, gen in zip(batch, gens):
                job.future.set_result(gen)
        while True:  # closed: whatever is still queued will never run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(HstapError("engine closed before this request ran"))

    def _decode(self, requests: list[Request]) -> list[Generation]:
        with self._decoding:
            return self._decode_unlocked(requests)

    def _decode_unlocked(self, requests: list[Request]) -> list[Generation]:
        longest = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
        if longest > self.max_len and len(requests) > 1:  # each fits alone (submit checked): split the batch
            half = len(requests) // 2
            return self._decode_unlocked(requests[:half]) + self._decode_unlocked(requests[half:])
        seed = requests[0].seed
        if seed is None:
            seed, self._seed = self._seed, self._seed + 1
        generator = None
        if any(r.temperature > 0 for r in requests):
            generator = torch.Generator(device=self.device).manual_seed(seed)
        with torch.inference_mode():
            return decode(self.stepper, requests, self.pad_id, self.stop_ids, self.device, generator, self.sync_every)


class EmbeddedBackend:
    """The synth Backend over an Engine: renders the chat exactly as capture will, queues it, decodes the answer."""

    def __init__(self, target, max_batch: int = 16, cuda_graphs: bool | None = None, compile_step: bool = False):
        self.target = target
        self.model_id = target.model_id
        self.engine = Engine(target, max_batch=max_batch, cuda_graphs=cuda_graphs, compile_step=compile_step)

    async def complete(self, messages: list[dict[str, str]], sampling) -> "Completion":
        import asyncio

        from hstap.data import render_prompt
        from hstap.synth.backend import Completion, RequestFailed

        prompt = render_prompt(messages, self.target.tokenizer)
        request = Request(prompt=prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, seed=sampling.seed)
        try:
            gen = await asyncio.wrap_future(self.engine.submit(request))
        except HstapError as exc:
            raise RequestFailed(str(exc)) from None
        text = self.target.tokenizer.decode(gen.tokens, skip_special_tokens=False)
        return Completion(content=text, finish_reason=gen.finish_reason, prompt_tokens=gen.prompt_tokens,
                          completion_tokens=gen.completion_tokens)

    def close(self) -> None:
        self.engine.close()
