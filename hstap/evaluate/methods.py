"""Evaluation's decoding methods on the runtime: vanilla, and speculative with n-gram, chain or tree drafts.

Every method runs on one `hstap.runtime.target.Runtime` (static cache, CUDA graphs on a GPU), batch by batch,
so the speedup is measured against vanilla decoding on the same backend. A `MeasuredGeneration` is one prompt's
answer with the counts τ is made of and the time it took (the runtime's own `hstap.runtime.decode.Generation` is the
bare answer). The runtime prefills through its lean forward (the default): nothing here hooks the model, and the
prefill is part of every measured batch.

    methods = Methods(model, drafter, batch_size=8, max_len=1024)
    gens = methods.run(DraftShape.parse("tree:8,8,60"), prompts, 256, stop_ids={2})
    gen = speculative_generate(model, drafter, prompt_ids, DraftShape.parse("chain:3"), 64, {2})   # one prompt
    gen.tokens, gen.tau, gen.accepted

τ counts what verification forwards produce: the first new token comes from the prefill forward and counts in
neither the tokens nor the forwards (so vanilla decoding has τ = 1 and a chain of K has τ ≤ K + 1). Tokens past a
stop token or max_new_tokens are dropped, and not counted, even when the target accepted them. At batch > 1 the
batch's wall time (and its drafting / verification time) is shared equally by its prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hstap.drafter import Eagle3Drafter
from hstap.metrics import acceptance_length
from hstap.runtime.decode import Request, decode
from hstap.runtime.graphs import StageClock
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from hstap.runtime.target import LEN_BUCKET, PREFILL_BUCKET, Runtime


@dataclass
class MeasuredGeneration:
    """One answer and how it was produced. Per verification forward: draft tokens accepted (before any cut at
    a stop or max_new_tokens), tokens kept (accepted + bonus, after the cut) and draft tokens proposed."""

    tokens: list[int]
    seconds: float
    verify_forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # this prompt's share of its batch's drafting and verification time
    verify_seconds: float = 0.0
    between_seconds: float = 0.0  # ... of the device time between cycles (waiting for the host to launch the next)
    prefill_seconds: float = 0.0  # ... of the prefill, first token and the drafter's start
    cycles: float = 0.0  # its share of its batch's verification cycles (what draft/verify seconds were spent in)

    @property
    def tau(self) -> float:
        """Tokens per verification forward, bonus included (NaN when the prefill produced everything)."""
        if self.verify_forwards == 0:
            return float("nan")
        return acceptance_length(sum(self.emitted), self.verify_forwards)


class Methods:
    """Vanilla decoding and speculative decoders of any shape over one runtime (one set of graphs per shape)."""

    def __init__(self, model: torch.nn.Module, drafter: Eagle3Drafter | None, batch_size: int, max_len: int,
                 shapes: list[DraftShape] = (), cuda_graphs: bool | None = None, fused: bool | None = None,
                 prefill: str = "lean", prefill_bucket: int = PREFILL_BUCKET, kv_write: str = "scatter",
                 clock: Callable[[], float] = time.perf_counter):
        # one cache length for the whole run (prompt + answer + the largest shape's draft columns): every batch
        # replays the same graphs
        reserve = max([SpecDecoder.reservation(s) for s in shapes], default=0)
        length = -(-(max_len + reserve) // LEN_BUCKET) * LEN_BUCKET
        self.runtime = Runtime(model, batch_size, max_len, cuda_graphs, len_bucket=length, max_slots=1,
                               prefill=prefill, prefill_bucket=prefill_bucket, kv_write=kv_write)
        # prefill "model": transformers' forward (a bench's A/B of the two); prefill_bucket 0: never graphed;
        # kv_write: the target cache's write form (an A/B of bench/spec_decode.py --kv-write)
        self.drafter, self.fused = drafter, fused  # fused: compiled graph bodies (SpecDecoder; default on CUDA)
        self.decoders: dict[str, SpecDecoder] = {}
        self.pad_id = 0
        self.clock = clock  # seconds: what a batch's wall time is read from (a test's own clock, or the real one)

    def decoder(self, shape: DraftShape) -> SpecDecoder:
        if shape.spec not in self.decoders:
            self.decoders[shape.spec] = SpecDecoder(self.runtime, shape, self.drafter, fused=self.fused)
        return self.decoders[shape.spec]

    def run(self, shape: DraftShape | None, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
            temperature: float = 0.0, generator: torch.Generator | None = None) -> list[MeasuredGeneration]:
        """One batch (at most batch_size prompts) with one method (None = vanilla)."""
        device = self.runtime.device
        stage_clock = StageClock(device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = self.clock()
        if shape is None:
            gens = self._vanilla(prompts, max_new_tokens, stop_ids, temperature, generator)
        else:
            dec = self.decoder(shape)
            dec.clock = stage_clock
            rows = dec.generate(prompts, max_new_tokens, stop_ids, self.pad_id, temperature, generator=generator)
            gens = [MeasuredGeneration(tokens=r.tokens, seconds=0.0, verify_forwards=len(r.accepted),
                                       accepted=r.accepted, emitted=r.emitted, drafted=r.drafted) for r in rows]
        sync()
        share = (self.clock() - start) / len(prompts)
        stages = stage_clock.totals()
        cycles = max(g.verify_forwards for g in gens)
        for g in gens:
            g.cycles = cycles / len(prompts)
            g.seconds = share
            g.draft_seconds = stages.get("draft", 0.0) / len(prompts)
            g.verify_seconds = stages.get("verify", 0.0) / len(prompts)
            g.between_seconds = stages.get("between", 0.0) / len(prompts)
            g.prefill_seconds = stages.get("prefill", 0.0) / len(prompts)
        return gens

    def _vanilla(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], temperature: float,
                 generator: torch.Generator | None) -> list[MeasuredGeneration]:
        device = self.runtime.device
        requests = [Request(p, max_new_tokens, temperature=temperature) for p in prompts]
        with torch.inference_mode():
            out = decode(self.runtime, requests, self.pad_id, sorted(stop_ids), device, generator,
                         sync_every=8 if device.type == "cuda" else 1)
        gens = []
        for g in out:
            tokens = g.tokens + ([g.stop_token] if g.stop_token is not None else [])
            steps = len(tokens) - 1  # the first token came from prefill
            gens.append(MeasuredGeneration(tokens=tokens, seconds=0.0, verify_forwards=steps, accepted=[0] * steps,
                                           emitted=[1] * steps, drafted=[0] * steps))
        return gens


def vanilla_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                     temperature: float = 0.0, generator: torch.Generator | None = None) -> MeasuredGeneration:
    """Plain decoding of one prompt on a fresh runtime (convenient for scripts; `Methods` reuses one)."""
    methods = Methods(model, None, 1, len(prompt_ids) + max_new_tokens)
    return methods.run(None, [prompt_ids], max_new_tokens, stop_ids, temperature, generator)[0]


def speculative_generate(model: torch.nn.Module, drafter: Eagle3Drafter | None, prompt_ids: list[int],
                         shape: DraftShape, max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> MeasuredGeneration:
    """Speculative decoding of one prompt on a fresh runtime; greedy output equals `vanilla_generate`'s."""
    methods = Methods(model, drafter, 1, len(prompt_ids) + max_new_tokens, [shape])
    return methods.run(shape, [prompt_ids], max_new_tokens, stop_ids, temperature, generator)[0]
