"""Repetition loops at the end of answers: the pure rule (tables), the cut on a loss mask, and real data — the
target's own greedy answer that loops, and real ShareGPT answers that must never be taken for loops."""

from __future__ import annotations

import pytest

from hstap.data import Conversation, SkipReport, open_source, render, render_all, render_prompt
from hstap.data.loops import LoopRule, answer_spans, cut_loops, periodic_tail
from hstap.errors import HstapError

UNIT = [11, 12, 13, 14, 15, 16, 17, 18]  # a period of 8 tokens


@pytest.mark.parametrize("ids, expected", [
    (UNIT * 4, (8, 32)),  # a loop from the first token
    ([1, 2, 3, 4, 5] + UNIT * 4, (8, 32)),  # after a prefix
    ([1, 2, 3] + UNIT * 4 + UNIT[:5], (8, 37)),  # ends inside a period: still periodic to the end
    ([7] * 30, (1, 30)),  # one token repeated: the shortest period wins over 2, 3, ...
    ([1, 2] * 15, (2, 30)),
    (UNIT * 2 + [99] * 3, (0, 0)),  # 2 occurrences of the period and 3 of a token: not enough of either
    ([1, 2, 3] * 7, (0, 0)),  # 21 tokens: under min_tokens
    (list(range(100)), (0, 0)),  # no repetition at all
    ([i // 2 for i in range(60)], (0, 0)),  # a list whose entries vary: never periodic
    ((UNIT * 9)[:70] + [1], (8, 71)),  # a token after the loop (a re-tokenized cut): still the answer's end
    ((UNIT * 9)[:70] + [1, 2, 3], (0, 0)),  # three: the loop is not at the end
    (list(range(70)) * 3, (0, 0)),  # period 70 > max_period 64
])
def test_periodic_tail(ids, expected):
    assert periodic_tail(ids) == expected


def test_periodic_tail_follows_the_rule():
    assert periodic_tail([1, 2, 3] * 7, LoopRule(min_tokens=9)) == (3, 21)
    assert periodic_tail(list(range(70)) * 3, LoopRule(max_period=70)) == (70, 210)


@pytest.mark.parametrize("mask, spans", [
    ([], []), ([False, False], []), ([True], [(0, 1)]),
    ([False, True, True, False, True], [(1, 3), (4, 5)]),
])
def test_answer_spans(mask, spans):
    assert answer_spans(mask) == spans


EOT = 2


def test_a_loop_in_the_last_answer_ends_the_sample_after_one_repeat():
    prompt = [100, 101, 102]
    answer = [5, 6] + UNIT * 5 + [EOT]  # a capped answer: the template closed it
    ids, mask = prompt + answer, [False] * 3 + [True] * len(answer)
    new_ids, new_mask, cuts = cut_loops(ids, mask, end_id=EOT)
    assert new_ids == prompt + [5, 6] + UNIT * 2  # the first period and one repeat
    assert new_mask == [False] * 3 + [True] * 18
    assert cuts == [len(ids) - len(new_ids)] == [25]


def test_a_loop_in_an_earlier_answer_leaves_the_context_and_only_changes_the_mask():
    first = [5] + UNIT * 4 + [EOT]
    second_turn = [100, 101]
    second = [40, 41, 42, EOT]
    ids = [100] + first + second_turn + second
    mask = [False] + [True] * len(first) + [False] * 2 + [True] * len(second)
    new_ids, new_mask, cuts = cut_loops(ids, mask, end_id=EOT)
    assert new_ids == ids  # the next question and answer were produced after the whole loop: context kept
    kept = 1 + 1 + 16  # prompt token, [5], two periods
    assert new_mask[:kept] == mask[:kept] and not any(new_mask[kept:1 + len(first)])
    assert new_mask[1 + len(first):] == mask[1 + len(first):]
    assert cuts == [len(first) - 17]


def test_answers_without_a_loop_are_untouched():
    ids = [100, 5, 6, 7, EOT, 101, 8, 9, EOT]
    mask = [False, True, True, True, True, False, True, True, True]
    assert cut_loops(ids, mask, end_id=EOT) == (ids, mask, [])


def test_render_rejects_an_unknown_loops_value(tokenizer):
    conv = next(iter(open_source("sharegpt", limit=1)))
    with pytest.raises(HstapError, match="loops must be 'keep' or 'cut'"):
        render(conv, tokenizer, loops="drop")


def test_real_sharegpt_answers_are_never_taken_for_loops(tokenizer):
    """ChatGPT's answers in ShareGPT hold lists, tables and code, which repeat structure but not tokens: on 300
    conversations not one answer is cut, and the samples are equal. (Of the first 2,000, one is: a song whose
    outro sings one line three times, `bench/loop_stats.py --data sharegpt --limit 2000`.)"""
    cut, kept = SkipReport(), SkipReport()
    with_cut = render_all("sharegpt", tokenizer, cut, max_tokens=2048, limit=300, loops="cut")
    without = render_all("sharegpt", tokenizer, kept, max_tokens=2048, limit=300)
    assert "loop_cut" not in cut.counts and cut.counts == kept.counts
    assert [s.input_ids for s in with_cut] == [s.input_ids for s in without]


def test_the_targets_own_looping_answer_is_cut_after_one_repeat(target):
    """SmolLM2, greedy, on a real ShareGPT request it answers with a verse it repeats until the cap: rendered with
    `loops="cut"`, the answer keeps its first period and one repeat, counted in the report."""
    from tests.runtime.conftest import greedy_reference

    conv = next(c for c in open_source("sharegpt", limit=64) if c.id == "juND8Ql_0")  # "Write a rap song about …"
    question = conv.messages[:1]
    tokenizer = target.tokenizer
    answer_ids = greedy_reference(target.model, render_prompt(question, tokenizer), 96, set(target.stop_ids))
    assert periodic_tail(answer_ids)[0], tokenizer.decode(answer_ids)  # it does loop within 96 tokens
    looped = Conversation(conv.id, question + [{"role": "assistant", "content": tokenizer.decode(answer_ids)}],
                          conv.source)
    report = SkipReport()
    whole = render(looped, tokenizer)
    cut = render(looped, tokenizer, report=report, loops="cut")
    ((start, end),) = answer_spans(whole.loss_mask)
    assert whole.input_ids[end - 1] == tokenizer.eos_token_id  # the template's end of turn closes the answer
    period, tail = periodic_tail(whole.input_ids[start:end - 1])
    keep_until = end - 1 - tail + 2 * period  # the first period and one repeat
    assert report.counts == {"loop_cut": 1, "loop_tokens_cut": end - keep_until}  # loss tokens: loop + end of turn
    assert cut.input_ids == whole.input_ids[:keep_until]  # and the template's newline after it: nothing follows
    assert cut.loss_mask == [False] * start + [True] * (len(cut.input_ids) - start)
    assert "skipped 0; loop_cut 1; loop_tokens_cut" in report.summary()
