"""Magpie-style prompts: the target writes the user's message itself, from its chat template cut where a user
message starts.

    from hstap.synth.magpie import MagpieSampler, judge
    sampler = MagpieSampler(target, seed=0, batch_size=16, temperature=1.0, top_p=0.99, max_new_tokens=256)
                                                               # an Engine: CUDA graphs on a GPU, eager on a CPU
    for cand in sampler.round(start=0):                        # attempts 0..15, one decode batch
        reason = judge(cand, FilterSettings(), dedupe, sampler.special_strings)   # None: keep it
    sampler.close()

The prompt of attempt k is `<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n` for SmolLM2 (any chat
template: the render of [system, user] cut at the user's content), where `system` is one of the wordings for
MT-bench category CATEGORIES[k % 8] (hstap/data/categories.py), picked by the seed. The model continues with the
user's message and ends it with its end-of-turn token, one of the engine's stop ids. A batch is decoded with
`Engine.generate_batch`, seeded by (seed, first attempt): the same seed, batch size and device give the same
prompts. A sample that hits `max_new_tokens` without ending is `unfinished`; the rest go through the prompt rules
(hstap/data/filters.py) and the deduper.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from hstap.data.categories import CATEGORIES, SYSTEM_PROMPTS
from hstap.data.dedupe import Deduper
from hstap.data.filters import FilterSettings, prompt_problem
from hstap.data.types import Conversation
from hstap.errors import HstapError
from hstap.runtime.engine import Engine, Request

SOURCE = "magpie"
_MARK = "HSTAP-USER-MESSAGE-STARTS-HERE"


def user_prefix(tokenizer, system: str) -> str:
    """The chat template rendered up to the first character of a user message that follows `system`."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise HstapError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: magpie needs an instruct model")
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": _MARK}],
                                         tokenize=False)
    if text.count(_MARK) != 1 or system not in text[:text.index(_MARK)]:
        raise HstapError(f"chat template of {tokenizer.name_or_path!r} does not render a system turn then the user's "
                         f"text verbatim: it cannot be cut where the user message starts")
    return text[:text.index(_MARK)]


def attempt_plan(attempt: int, seed: int) -> tuple[str, int]:
    """(category, system wording index) of attempt `attempt`: categories in turn, the wording by the seed."""
    category = CATEGORIES[attempt % len(CATEGORIES)]
    return category, random.Random(f"{seed}/{attempt}").randrange(len(SYSTEM_PROMPTS[category]))


def attempt_id(attempt: int) -> str:
    return f"{SOURCE}-{attempt:07d}"


def attempt_of(record_id: str) -> int | None:
    """The attempt number in a magpie record id, None for another source's id."""
    prefix = f"{SOURCE}-"
    tail = record_id[len(prefix):] if record_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class Candidate:
    """One sampled user message (`text` decoded with special tokens kept, so leftovers are visible)."""

    attempt: int
    category: str
    variant: int
    text: str
    n_tokens: int
    finish_reason: str

    def conversation(self) -> Conversation:
        return Conversation(id=attempt_id(self.attempt), source=SOURCE,
                            messages=[{"role": "user", "content": self.text.strip()}],
                            meta={"category": self.category, "system_variant": self.variant})


class MagpieSampler:
    """Samples user messages from the target in rounds of `batch_size` attempts."""

    def __init__(self, target, *, seed: int, batch_size: int, temperature: float, top_p: float, max_new_tokens: int,
                 cuda_graphs: bool | None = None):
        """Sampling as `hstap prompts` sets it (hstap.data.config.PromptsConfig holds the defaults); `cuda_graphs`
        None: the Engine's default for the device."""
        self.tokenizer, self.seed, self.batch_size = target.tokenizer, seed, batch_size
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}
        self.prefixes = {(cat, k): self.tokenizer(user_prefix(self.tokenizer, system), add_special_tokens=False)
                         ["input_ids"] for cat in CATEGORIES for k, system in enumerate(SYSTEM_PROMPTS[cat])}
        added = self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else {}
        self.special_strings = sorted(set(added) | set(self.tokenizer.all_special_tokens))
        # the runtime's lean prefill (Engine's default): nothing hooks the model while prompts are sampled
        self.engine = Engine(target, max_batch=batch_size, cuda_graphs=cuda_graphs, seed=seed)

    def round(self, start: int) -> list[Candidate]:
        """Attempts start .. start + batch_size - 1, decoded as one batch."""
        plans = [attempt_plan(a, self.seed) for a in range(start, start + self.batch_size)]
        seed = zlib.crc32(f"{self.seed}/{start}".encode()) % 2**31  # stable across runs, unlike hash()
        requests = [Request(prompt=self.prefixes[plan], seed=seed, **self.sampling) for plan in plans]
        gens = self.engine.generate_batch(requests)
        return [Candidate(attempt=start + k, category=cat, variant=variant,
                          text=self.tokenizer.decode(gen.tokens, skip_special_tokens=False),
                          n_tokens=len(gen.tokens), finish_reason=gen.finish_reason)
                for k, ((cat, variant), gen) in enumerate(zip(plans, gens))]

    def close(self) -> None:
        self.engine.close()


def judge(cand: Candidate, settings: FilterSettings, dedupe: Deduper, special_strings: list[str]) -> str | None:
    """None if `cand` is kept (the deduper then remembers it), else the drop reason."""
    if cand.finish_reason != "stop":
        return "unfinished"
    reason = prompt_problem(cand.text, cand.n_tokens, settings, special_strings)
    return reason if reason is not None else dedupe.admit(cand.text)
