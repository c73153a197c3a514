"""The batched decode loop over a stepper, and the reference stepper on transformers' DynamicCache.

    gens = decode(stepper, [Request(prompt=ids, max_new_tokens=128)], pad_id, stop_ids, device)

A stepper owns the KV cache and runs the forward: `hstap.runtime.target.Runtime` (static cache, lean forward,
CUDA graphs on a GPU: what the Engine uses) or `EagerStepper` (transformers' DynamicCache, exactly what
`generate` feeds the model: the reference the tests compare against, and the fallback for targets the lean
forward does not run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from hstap.faults import fault_point
from hstap.runtime.target import positions_from_mask


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both [B, P]: each prompt right-aligned so that every row's next token is at column P."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


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
    stop_token: int | None = None  # the stop id that ended it (finish_reason "stop")

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
        fault_point("decode-step")  # HSTAP_FAULT=decode-step:N: killed mid-batch (synth loses only this batch)
    return _finish(out.cpu().tolist(), requests, set(stop_ids))


def _finish(rows: list[list[int]], requests: list[Request], stops: set[int]) -> list[Generation]:
    return [generation_of(row, req, stops) for row, req in zip(rows, requests)]


def generation_of(row: list[int], request: Request, stops: set[int]) -> Generation:
    """A finished row's tokens as its Generation: cut at the first stop id within max_new_tokens, or at the
    limit (a static batch's rows and continuous batching's rows end the same way)."""
    row = row[:request.max_new_tokens]
    end = next((k for k, tok in enumerate(row) if tok in stops), None)
    reason = "length" if end is None else "stop"
    return Generation(tokens=row if end is None else row[:end], finish_reason=reason,
                      prompt_tokens=len(request.prompt), stop_token=None if end is None else row[end])


