"""Magpie on the real SmolLM2 (a handful of samples, few tokens, one thread): the template prefix, the stop at
<|im_end|>, reproducible sampling, and the filters and deduper applied to what the model wrote."""

from __future__ import annotations

import pytest

from hstap.data.categories import CATEGORIES, SYSTEM_PROMPTS
from hstap.data.dedupe import Deduper
from hstap.data.filters import FilterSettings
from hstap.data.mtbench import load_mtbench
from hstap.errors import HstapError
from hstap.synth.magpie import Candidate, MagpieSampler, attempt_of, attempt_plan, judge, user_prefix

BATCH = 8
NEW = 24  # enough for short messages to end (the seeded round below has two that do), cheap on one CPU thread


@pytest.fixture(scope="module")
def sampler(target):
    s = MagpieSampler(target, seed=0, batch_size=BATCH, temperature=1.0, top_p=0.99, max_new_tokens=NEW)
    yield s
    s.close()


@pytest.fixture(scope="module")
def first_round(sampler):
    return sampler.round(0)


def test_prefix_is_chatml_up_to_the_user_message(tokenizer):
    system = SYSTEM_PROMPTS["math"][0]
    assert user_prefix(tokenizer, system) == f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def test_prefix_tokens_end_in_the_user_header(sampler, tokenizer):
    ids = sampler.prefixes[("coding", 1)]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids[-3:]) == "<|im_start|>user\n"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in sampler.engine.stop_ids


def test_template_that_drops_the_system_turn_is_refused(tokenizer, monkeypatch):
    users_only = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    monkeypatch.setattr(tokenizer, "chat_template", users_only)
    with pytest.raises(HstapError, match="cannot be cut where the user message starts"):
        user_prefix(tokenizer, "You are a math tutor.")


def test_categories_are_mt_bench_s_and_attempts_cycle_through_them():
    assert set(CATEGORIES) == {q.meta["category"] for q in load_mtbench()}
    assert all(len(SYSTEM_PROMPTS[c]) >= 3 for c in CATEGORIES)
    assert [attempt_plan(a, 0)[0] for a in range(8)] == list(CATEGORIES)
    assert len({attempt_plan(a, 0)[1] for a in range(0, 200, 8)}) > 1, "the wording varies with the seed"
    assert attempt_of("magpie-0000042") == 42 and attempt_of("code-x") is None


def test_round_samples_user_messages_that_stop(first_round):
    assert [c.attempt for c in first_round] == list(range(BATCH))
    assert [c.category for c in first_round] == list(CATEGORIES)[:BATCH]
    stopped = [c for c in first_round if c.finish_reason == "stop"]
    assert stopped, f"some messages end with <|im_end|> within {NEW} tokens"
    assert all("<|im_end|>" not in c.text and c.n_tokens <= NEW for c in first_round)
    assert all(c.n_tokens == NEW for c in first_round if c.finish_reason == "length")


def test_same_seed_same_prompts(target):
    # three rows of three tokens: cheap on a CPU, and two seeds agreeing on all of them by chance is ~1e-4
    short = MagpieSampler(target, seed=0, batch_size=3, temperature=1.0, top_p=0.99, max_new_tokens=3)
    try:
        a, b = short.round(8), short.round(8)
        other = MagpieSampler(target, seed=1, batch_size=3, temperature=1.0, top_p=0.99, max_new_tokens=3)
        try:
            c = other.round(8)
        finally:
            other.close()
    finally:
        short.close()
    assert [x.text for x in a] == [x.text for x in b]
    assert [x.text for x in a] != [x.text for x in c]


def test_judge_applies_the_filters_and_the_deduper(first_round, sampler):
    dedupe = Deduper()
    verdicts = [judge(c, FilterSettings(), dedupe, sampler.special_strings) for c in first_round]
    assert all((v == "unfinished") == (c.finish_reason == "length") for c, v in zip(first_round, verdicts))
    kept = [c for c, v in zip(first_round, verdicts) if v is None]
    assert len(dedupe) == len(kept)
    for cand in kept:  # a second sight of a kept prompt is a duplicate
        assert judge(cand, FilterSettings(), dedupe, sampler.special_strings) == "exact_duplicate"


@pytest.mark.parametrize("text,finish,expected", [
    ("What is the derivative of x squared?", "stop", None),
    ("What is the derivative of x squared?", "length", "unfinished"),
    ("Sure! Here is the derivative: 2x.", "stop", "assistant_speak"),
    ("Solve 2x + 3 = 7.<|im_start|>assistant", "stop", "template_leftover"),
])
def test_judge_table(text, finish, expected, sampler):
    cand = Candidate(attempt=0, category="math", variant=0, text=text, n_tokens=12, finish_reason=finish)
    assert judge(cand, FilterSettings(), Deduper(), sampler.special_strings) == expected
    conv = cand.conversation()
    assert conv.id == "magpie-0000000" and conv.messages == [{"role": "user", "content": text}]
    assert conv.meta == {"category": "math", "system_variant": 0}
