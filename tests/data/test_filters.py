"""Prompt rules: each rule against hand-made prompts that must break it and ones that must not; MT-bench's real
questions as the positives."""

from __future__ import annotations

import pytest

from hstap.data import load_mtbench
from hstap.data.filters import (
    REASONS,
    FilterSettings,
    ascii_letter_share,
    compression_ratio,
    function_word_share,
    prompt_problem,
    repeated_ngram_share,
)

S = FilterSettings()
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>"]
LOOP = "Write a story about a dog. " * 6

# (text, generated tokens, expected reason): each rule with its positives, and near misses that pass (None)
CASES = [
    ("Write a haiku about autumn.<|im_end|>", 9, "template_leftover"),
    ("Summarise this file: <filename>notes.txt", 9, "template_leftover"),
    ("What is 2+2?\n<|im_start|>assistant\n4", 12, "template_leftover"),
    ("user\nWhat is the capital of Peru?", 9, "template_leftover"),
    ("Explain why the user of a library reads its docs.", 11, None),  # the word "user" inside prose is fine
    ("Hi?", 2, "too_short"),
    ("Why is the sky blue?", 6, None),
    ("Describe the sea. " * 150, 600, "too_long"),
    ("Is water wet or dry?", 3, "too_few_tokens"),
    ("Is water wet or dry?", 600, "too_many_tokens"),
    ("Je voudrais écrire une lettre à mon ami pour lui dire que je suis désolé de ne pas être venu.", 30,
     "not_english"),
    ("Puedes explicarme como funciona la fotosintesis en las plantas y por que es importante para la vida", 30,
     "not_english"),
    ("请帮我写一首关于秋天的诗，要有落叶和月亮。请用五言绝句的形式写。", 20, "not_english"),
    ("x+y = 4z, x*y = 4z^2, express x-y in z", 20, None),  # math, not French: no prose words to judge by
    ("Fix this:\n```python\nfor k in range(n):\n    tot += arr[k] * wts[k]\nreturn tot / n\n```", 30, None),
    (LOOP, 40, "repetitive"),
    ("ha" * 150, 100, "repetitive"),
    ("Compare cats and dogs as pets for a family with small children, a garden and little free time?", 25, None),
    ("I'm sorry, but I can't help with that request.", 11, "refusal"),
    ("I cannot assist with creating harmful content. Is there anything else?", 14, "refusal"),
    ("Sorry to bother you, but can you explain how vaccines work?", 14, None),
    ("As an AI language model, I do not have personal opinions on politics?", 14, "assistant_speak"),
    ("Hello! How can I assist you today?", 9, "assistant_speak"),
    ("Sure! Here is a poem about the sea: the waves roll in and out again.", 18, "assistant_speak"),
    ("Here are three tips for better sleep: go to bed early, avoid screens and exercise.", 19, "assistant_speak"),
    ("Here is my code. Why does it crash on empty input?", 13, None),  # a user sharing context, then asking
    ("The capital of France is Paris. It is known for the Eiffel Tower and its museums.", 18, "not_a_request"),
    ("Photosynthesis converts light energy into chemical energy stored in glucose molecules.", 14, "not_a_request"),
    ("Rephrase your previous answer as a limerick.", 10, None),
    ("I have been feeling tired all week and I keep forgetting things.", 14, None),
]


@pytest.mark.parametrize("text,tokens,expected", CASES, ids=[f"{e}-{k}" for k, (_, _, e) in enumerate(CASES)])
def test_rule_table(text, tokens, expected):
    assert prompt_problem(text, tokens, S, SPECIALS) == expected


def test_every_rule_has_a_positive_in_the_table():
    assert {e for _, _, e in CASES} - {None} == set(REASONS)


def test_mt_bench_questions_pass():
    """Real questions written by people: all 160 turns pass but one three-word German line (not a request)."""
    failed = [(q.id, t["content"]) for q in load_mtbench() for t in q.messages
              if prompt_problem(t["content"], 20, S, SPECIALS) is not None]
    assert [text for _, text in failed] == ["Ich verstehe nur Bahnhof"]


@pytest.mark.parametrize("field,value,text,before,after", [
    ("min_chars", 40, "Why is the sky blue?", None, "too_short"),
    ("max_repeated_ngrams", 0.9, LOOP, "repetitive", None),
    ("min_ascii_letters", 0.0, "请帮我写一首关于秋天的诗，要有落叶和月亮。请用五言绝句的形式写。", "not_english",
     "not_a_request"),  # the next rule: no English request word either
])
def test_settings_move_the_bounds(field, value, text, before, after):
    assert prompt_problem(text, 20, S) == before
    assert prompt_problem(text, 20, S.model_copy(update={field: value})) == after


def test_crossed_bounds_are_refused():
    with pytest.raises(ValueError, match="min_chars 50 is above max_chars 40"):
        FilterSettings(min_chars=50, max_chars=40)


def test_measures():
    assert ascii_letter_share("abc") == 1.0 and ascii_letter_share("") == 1.0
    assert ascii_letter_share("aé") == 0.5
    assert function_word_share(["the", "cat", "is", "here"]) == 0.75 and function_word_share([]) == 1.0
    assert repeated_ngram_share("a b c a b c".split()) == pytest.approx(0.25)  # abc bca cab abc: one repeat
    assert repeated_ngram_share(["a", "b"]) == 0.0
    prose = "Compare cats and dogs as pets for a family with small children, a garden and little free time."
    assert compression_ratio("x" * 1000) < 0.05 < 0.4 < compression_ratio(prose)
