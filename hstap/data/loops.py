"""Degenerate repetition loops at the end of answers: found on the token ids, and taken out of the loss.

A small target decoding greedily often ends an answer in a loop: the same 3 to 60 tokens again and again until
the token cap. SmolLM2's greedy answers (`bench/loop_stats.py`, docs/benchmarks.md): 26 of 64 ShareGPT
first turns at 384 new tokens end in one, and cutting each after its first repeat takes 30 % of the answer tokens
out of the loss; on MT-bench at 256 tokens, 20 of 80 answers, 14 %. A drafter trained on them spends those steps
learning to copy the last few dozen tokens, which prompt lookup (`hybrid:K`) does for free, and its held-out τ
estimate is inflated by the same tokens. `--loops cut` keeps each loop's first period plus `keep_repeats` repeats
(so the drafter still learns that a loop repeats), takes the rest out of the loss, and ends the sample there when
no answer follows (its tokens would be context for nothing). Whether that raises τ on held-out prompts is not
measured yet, so the default keeps every token.

    period, tail = periodic_tail(ids)                  # (0, 0) when the ids do not end in a loop
    ids, mask, cut = cut_loops(ids, mask, end_id=eos)  # per answer span of the loss mask

The rule is deliberately strict (≥ 3 occurrences of the period and ≥ 24 tokens of periodic tail, at most 2 tokens
after it), so a list or a table with varying entries is never mistaken for a loop: only a run where token i equals
token i − p throughout, at the answer's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopRule:
    """What counts as a loop: a tail of ≥ `min_tokens` tokens, periodic with a period ≤ `max_period`, holding at
    least `min_repeats` occurrences of it."""

    max_period: int = 64
    min_repeats: int = 3
    min_tokens: int = 24
    keep_repeats: int = 1  # repeats kept after the first period when cutting
    slack: int = 2  # tokens after the loop that still make it the answer's end


RULE = LoopRule()


def periodic_tail(ids: Sequence[int], rule: LoopRule = RULE) -> tuple[int, int]:
    """(period p, length of the loop's tail) of the longest loop `ids` end in, or (0, 0).

    The loop is the longest run where ids[i] == ids[i - p], plus the period it repeats; up to `rule.slack` tokens
    after it count as its tail too (text cut at a token cap, decoded and tokenized again, can end in a piece the
    loop never held: "you. " ends in a lone space where the loop had "you." + " I"). The shortest period wins a
    tie (a period-6 loop is also periodic in 12)."""
    n = len(ids)
    best = (0, 0)
    for slack in range(min(rule.slack, n) + 1):
        end = n - slack
        for p in range(1, min(rule.max_period, end // rule.min_repeats) + 1):
            i = end - 1
            while i >= p and ids[i] == ids[i - p]:
                i -= 1
            periodic = (end - 1 - i) + p  # the matching run plus the period it repeats
            if periodic >= rule.min_repeats * p and periodic >= rule.min_tokens and periodic + slack > best[1]:
                best = (p, periodic + slack)
    return best


def answer_spans(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of True in a loss mask (one per answer)."""
    spans, start = [], None
    for i, on in enumerate(mask):
        if on and start is None:
            start = i
        elif not on and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def cut_loops(ids: list[int], mask: list[bool], end_id: int | None,
              rule: LoopRule = RULE) -> tuple[list[int], list[bool], list[int]]:
    """Take the loop at the end of each answer out of the loss. Returns (ids, mask, tokens cut per looping answer).

    An answer is a run of True in `mask`; its end-of-turn token (`end_id`), when last, is not part of the text
    checked, and goes out of the loss with the loop (a capped answer's end-of-turn was written by the chat
    template, not by the target). When the looping answer is the sample's last, the sample ends after what is
    kept; earlier answers keep their tokens as context, out of the loss."""
    ids, mask = list(ids), list(mask)
    spans = answer_spans(mask)
    cuts: list[int] = []
    for number, (start, end) in enumerate(spans):
        content_end = end - 1 if end_id is not None and ids[end - 1] == end_id else end
        period, tail = periodic_tail(ids[start:content_end], rule)
        if not period:
            continue
        keep_until = content_end - tail + period * (1 + rule.keep_repeats)
        if keep_until >= content_end:  # a rule that keeps as many repeats as it needs to see: nothing to cut
            continue
        cuts.append(end - keep_until)
        if number == len(spans) - 1:
            del ids[keep_until:], mask[keep_until:]
        else:
            mask[keep_until:end] = [False] * (end - keep_until)
    return ids, mask, cuts
