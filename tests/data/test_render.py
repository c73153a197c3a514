"""Rendering with the real SmolLM2 tokenizer: token-exact assistant-only masks on real ShareGPT conversations."""

from __future__ import annotations

import pytest

from hstap.data import Conversation, RenderedSample, SkipReport, load_mtbench, open_source, render, render_prompt
from hstap.data.loops import answer_spans
from hstap.errors import HstapError

EOT = "<|im_end|>"
HEADER = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def convs():
    return list(open_source("sharegpt", limit=50))


@pytest.fixture(scope="module")
def samples(convs, tokenizer):
    report = SkipReport()
    out = [render(c, tokenizer, report=report) for c in convs]
    assert report.counts == {}, report.summary()
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_sample_covers_multi_turn(convs):
    assert len(convs) == 50
    assert sum(sum(m["role"] == "assistant" for m in c.messages) >= 3 for c in convs) >= 10


def test_masked_runs_are_exactly_answers_plus_eot(convs, samples, tokenizer):
    for conv, s in zip(convs, samples):
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        runs = answer_spans(s.loss_mask)
        assert [_decode(tokenizer, s.input_ids[a:b]) for a, b in runs] == [a + EOT for a in answers], conv.id
        for (a, b), answer in zip(runs, answers):
            # The very tokens the target emits when it generates the answer after the header.
            assert s.input_ids[a:b] == tokenizer(answer + EOT, add_special_tokens=False)["input_ids"], conv.id
            assert _decode(tokenizer, s.input_ids[:a]).endswith(HEADER), conv.id
            assert _decode(tokenizer, s.input_ids[b:b + 1]) == "\n", conv.id


def test_full_decode_equals_template_text(convs, samples, tokenizer):
    for conv, s in zip(convs, samples):
        text = tokenizer.apply_chat_template(conv.messages, tokenize=False)
        assert _decode(tokenizer, s.input_ids) == text, conv.id
        assert len(s.input_ids) == len(s.loss_mask) and s.id == conv.id


def test_render_prompt_is_prefix_of_rendered_sample(convs, samples, tokenizer):
    for conv, s in list(zip(convs, samples))[:10]:
        runs = iter(answer_spans(s.loss_mask))
        for i, m in enumerate(conv.messages):
            if m["role"] == "assistant":
                start, _ = next(runs)
                assert render_prompt(conv.messages[:i], tokenizer) == s.input_ids[:start], (conv.id, i)


def test_truncate_skip_and_prompt_over_max_tokens(convs, samples, tokenizer):
    conv, full = convs[0], samples[0]
    first_masked = full.loss_mask.index(True)
    report = SkipReport()
    cut = render(conv, tokenizer, max_tokens=first_masked + 3, report=report)
    assert cut.input_ids == full.input_ids[:first_masked + 3] and sum(cut.loss_mask) == 3
    assert render(conv, tokenizer, max_tokens=first_masked + 3, overlong="skip", report=report) is None
    assert render(conv, tokenizer, max_tokens=first_masked, report=report) is None
    assert render(conv, tokenizer, max_tokens=len(full.input_ids), overlong="skip", report=report) == full
    assert report.counts == {"truncated": 1, "too_long": 1, "prompt_over_max_tokens": 1}


def test_mtbench_prompt_all_false_and_generation_header(tokenizer):
    q = load_mtbench()[0]
    s = render(q, tokenizer, max_tokens=8)  # a prompt with no answers is just truncated
    assert isinstance(s, RenderedSample) and len(s.input_ids) == 8 and not any(s.loss_mask)
    s = render(q, tokenizer)
    assert not any(s.loss_mask)
    assert _decode(tokenizer, s.input_ids) == tokenizer.apply_chat_template(q.messages, tokenize=False)
    prompt = render_prompt(q.messages[:1], tokenizer)
    header = tokenizer(HEADER, add_special_tokens=False)["input_ids"]
    assert prompt[-len(header):] == header
    assert _decode(tokenizer, prompt).endswith(q.messages[0]["content"] + EOT + "\n" + HEADER)


def test_piecewise_tokenization_differs_from_whole_text_at_boundaries(tokenizer):
    # An answer starting with newlines: whole-text tokenization merges them with the header's "\n"; the
    # masked tokens must still be tokenize(answer + eot), what the target generates after the header.
    conv = Conversation("nl", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nx"}], "t")
    s = render(conv, tokenizer)
    (a, b), = answer_spans(s.loss_mask)
    assert s.input_ids[a:b] == tokenizer("\n\nx" + EOT, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != s.input_ids


def test_special_token_text_is_skipped(tokenizer):
    conv = Conversation("sp", [{"role": "user", "content": "say <|endoftext|>"},
                               {"role": "assistant", "content": "ok"}], "t")
    report = SkipReport()
    assert render(conv, tokenizer, report=report) is None
    assert report.counts == {"special_token_text": 1}


class _BrokenTemplate:
    """The real tokenizer with a template whose output depends on the number of messages."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        return f"[{len(messages)} turns]" + self._tok.apply_chat_template(messages, **kwargs)


def test_non_prefix_stable_template_raises(tokenizer):
    conv = Conversation("x", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "t")
    with pytest.raises(HstapError, match="not prefix-stable"):
        render(conv, _BrokenTemplate(tokenizer))


def test_bad_overlong_value_raises(tokenizer):
    conv = Conversation("x", [{"role": "user", "content": "q"}], "t")
    with pytest.raises(HstapError, match="overlong must be 'truncate' or 'skip'"):
        render(conv, tokenizer, overlong="drop")


def test_a_1mb_question_is_dropped_as_prompt_over_max_tokens_not_no_answer(tokenizer):
    """Issue 13: a 1 MB user message used to be counted as `no_assistant_tokens` — as if the data had no answers.
    Its answer starts past --max-tokens: that is what the count now says."""
    big = ("The quick brown fox jumps over the lazy dog. " * 23500)[:2**20]
    conv = Conversation("big", [{"role": "user", "content": big}, {"role": "assistant", "content": "Done."}], "x")
    report = SkipReport()
    assert render(conv, tokenizer, max_tokens=2048, report=report) is None
    assert report.counts == {"prompt_over_max_tokens": 1}
