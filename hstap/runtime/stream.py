"""Continuous batching: the runtime's rows are refilled with waiting requests as others finish.

A static batch (`decode`) runs until its longest row ends: rows that stopped early idle, and a request that arrives
meanwhile waits for the whole batch. Here every row holds one request at a time. Every `sync_every` steps the host
reads the tokens made since its last read (one copy), finishes the rows that stopped or reached their
max_new_tokens, and prefills waiting requests into the free rows (`Runtime.admit`: the runtime's prefill, its keys and
values written into those rows only) while the other rows keep their caches and positions. The step itself is the
runtime's one-token step (a CUDA graph replay on a GPU), unchanged: each row reads only its own columns
[start, write_at), so a row admitted at column 0 sits beside rows hundreds of columns on.

    session = Session(runtime, pad_id, stop_ids, sync_every=8, seed=0)
    session.run(waiting, poll, deliver, fail)  # waiting: deque of (tag, Request); deliver(tag, Generation)
    session.run(waiting, poll, deliver, fail, progress)  # progress(tag, tokens) -> False: free that row now

Greedy rows get exactly the tokens a batch of their own would (tests: token for token against `decode` on the
same runtime and against one-request batches, fp32). Sampled rows draw from one generator per session, so which
tokens they get depends on which requests shared the session, as with static batches.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from hstap.faults import fault_point
from hstap.runtime.decode import Generation, Request, generation_of, left_pad, pick_next
from hstap.runtime.target import Runtime

ADMIT_SHARE = 8  # admit once 1/ADMIT_SHARE of the rows are free (or nothing is decoding): fewer, larger prefills


class Session:
    """One slot of the runtime decoding a changing set of requests until none is left that fits it."""

    def __init__(self, runtime: Runtime, pad_id: int, stop_ids: list[int], sync_every: int = 1, seed: int = 0):
        self.rt, self.pad_id, self.stops = runtime, pad_id, set(stop_ids)
        self.sync_every = max(1, sync_every)
        self.generator = torch.Generator(device=runtime.device).manual_seed(seed)
        self.rows = runtime.batch_size
        self.admit_min = max(1, self.rows // ADMIT_SHARE)
        self.peak = 0  # the most rows busy at once so far (a server's proof that requests were batched)

    def need(self, request: Request) -> int:
        """Cache columns a request takes: prompt, answer, and the steps it may run past its end before the host
        reads that it stopped."""
        return len(request.prompt) + request.max_new_tokens + self.sync_every

    def run(self, waiting: deque[tuple[object, Request]], poll: Callable[[], bool],
            deliver: Callable[[object, Generation], None], fail: Callable[[object, Exception], None],
            progress: Callable[[object, list[int]], bool] | None = None) -> None:
        """Decode requests from the head of `waiting` (FIFO) until no row is busy and the head does not fit this
        session's cache (or nothing waits). `poll()` moves newly arrived requests into `waiting` and returns False
        once no more may be admitted (closing). Each finished request goes to `deliver(tag, generation)`; if
        decoding raises, every request in the session goes to `fail(tag, exception)` and the session ends (the
        requests still waiting stay in `waiting`). `progress(tag, tokens)` sees every unfinished row's tokens so
        far after each host read (a server streams them); when it returns False (nobody listens any more) the row
        is freed at once and delivered with the tokens it has."""
        self.progress = progress
        self.busy: list[_Row | None] = [None] * self.rows
        self.taking: list[tuple[object, Request]] = []  # popped from `waiting`, not yet in a row
        try:
            self._run(waiting, poll, deliver)
        except Exception as exc:  # a failed session fails its requests, never the caller's worker
            for tag in [b.tag for b in self.busy if b is not None] + [tag for tag, _ in self.taking]:
                fail(tag, exc)

    def _run(self, waiting: deque[tuple[object, Request]], poll: Callable[[], bool],
             deliver: Callable[[object, Generation], None]) -> None:
        rt, device = self.rt, self.rt.device
        slot = rt.open_slot(max(self.need(r) for _, r in list(waiting)[:self.rows]))
        self.temperature = torch.zeros(self.rows, dtype=torch.float32, device=device)  # (B,)
        self.top_p = torch.ones(self.rows, dtype=torch.float32, device=device)  # (B,)
        self.idle = torch.ones(self.rows, dtype=torch.bool, device=device)  # (B,) rows whose tokens are ignored
        chunk = torch.full((self.rows, self.sync_every), self.pad_id, dtype=torch.long, device=device)  # (B, T)
        logits = slot.logits  # (B, V): the step's output buffer; admitted rows' first logits are written into it
        admitting = True
        while True:
            admitting = admitting and poll()
            free = [r for r, b in enumerate(self.busy) if b is None]
            if admitting and waiting and free and (len(free) >= self.admit_min or len(free) == self.rows):
                self._admit(waiting, free, slot.length, logits)
            live = [b for b in self.busy if b is not None]
            if not live:
                return
            sampled = any(b.request.temperature > 0 for b in live)  # else plain argmax: no sort, no draw
            slot.bound = max(b.written for b in live)  # the eager path attends to columns [0, bound + 1)
            for t in range(self.sync_every):
                tokens = pick_next(logits, self.temperature if sampled else None, self.top_p if sampled else None,
                                   self.generator).masked_fill(self.idle, self.pad_id)  # (B,)
                chunk[:, t] = tokens
                logits = rt.step(tokens)
                fault_point("decode-step")  # HSTAP_FAULT=decode-step:N: killed mid-answer (synth loses these rows)
            self._collect(chunk.tolist(), deliver)

    def _admit(self, waiting: deque[tuple[object, Request]], free: list[int], length: int,
               logits: torch.Tensor) -> None:
        """Move the head of `waiting` into free rows while it fits this slot, in one prefill."""
        taken = self.taking = []
        while waiting and len(taken) < len(free) and self.need(waiting[0][1]) <= length:
            taken.append(waiting.popleft())
        if not taken:
            return
        rows = free[:len(taken)]
        device = self.rt.device
        ids, mask = left_pad([r.prompt for _, r in taken], self.pad_id, device)
        index = torch.tensor(rows, dtype=torch.long, device=device)  # (k,)
        logits[index] = self.rt.admit(rows, ids, mask)  # (k, V) their first tokens' logits
        self.temperature[index] = torch.tensor([r.temperature for _, r in taken], dtype=torch.float32, device=device)
        self.top_p[index] = torch.tensor([r.top_p for _, r in taken], dtype=torch.float32, device=device)
        self.idle[index] = False
        for row, (tag, request) in zip(rows, taken):
            self.busy[row] = _Row(tag, request, written=ids.shape[1])
        self.taking = []
        self.peak = max(self.peak, sum(b is not None for b in self.busy))

    def _collect(self, chunk: list[list[int]], deliver: Callable[[object, Generation], None]) -> None:
        """Append each busy row's new tokens; deliver and free the rows that stopped or reached their limit."""
        freed = []
        for row, new in enumerate(chunk):
            b = self.busy[row]
            if b is None:
                continue
            b.written += len(new)
            b.tokens.extend(new)
            gen = b.finished(self.stops)
            if gen is None and self.progress is not None and not self.progress(b.tag, b.tokens):
                gen = generation_of(b.tokens, b.request, self.stops)  # the listener is gone: free the row now
            if gen is not None:
                self.busy[row] = None
                freed.append(row)
                deliver(b.tag, gen)
        if freed:
            index = torch.tensor(freed, dtype=torch.long, device=self.rt.device)
            self.idle[index] = True
            self.temperature[index] = 0.0


class _Row:
    """A request in a row: its tokens so far and the row's write position (host copies)."""

    def __init__(self, tag: object, request: Request, written: int):
        self.tag, self.request, self.written = tag, request, written
        self.tokens: list[int] = []
        self.checked = 0  # tokens already searched for a stop id

    def finished(self, stops: set[int]) -> Generation | None:
        """The Generation once the row stopped (a stop id) or has max_new_tokens tokens, else None."""
        limit = self.request.max_new_tokens
        stopped = any(tok in stops for tok in self.tokens[self.checked:limit])
        self.checked = len(self.tokens)
        if stopped or len(self.tokens) >= limit:
            return generation_of(self.tokens, self.request, stops)
        return None
