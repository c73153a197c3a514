"""lab/merge_answers.py: an earlier session's answers join this session's by prompt content, not by record id
(another prompt seed reuses Magpie and code ids for different prompts)."""

from __future__ import annotations

import json

import pytest

import merge_answers


def _record(rid: str, *turns: str) -> dict:
    roles = ["user", "assistant"] * len(turns)
    return {"id": rid, "messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_prompts_are_matched_by_content_and_kept_once(tmp_path):
    new, prior = tmp_path / "synth.jsonl", tmp_path / "synth0.jsonl"
    _write(new, [_record("magpie-0000001", "Name three rivers.", "Nile, Amazon, Danube."),
                 _record("sharegpt-a_0", "what is chicken", "A bird.")])
    _write(prior, [_record("magpie-0000001", "Write a haiku about rain.", "Rain taps the window..."),  # id reused
                   _record("sharegpt-b_0", "what is chicken", "A bird."),  # the same prompt, another id
                   _record("sharegpt-c_1", "hi", "Hello!", "what is chicken", "A bird, as I said."),  # later turn
                   _record("magpie-0000002", "Write a haiku about rain.", "Rain again...")])  # duplicate in prior
    counts = merge_answers.merge(new, [prior])
    assert counts == {"this_session": 2, "prior_added": 2, "prior_answered_again": 2}
    kept = [json.loads(line) for line in new.read_text().splitlines()]
    assert [r["id"] for r in kept] == ["magpie-0000001", "sharegpt-a_0", "magpie-0000001", "sharegpt-c_1"]
    assert kept[2]["messages"][0]["content"] == "Write a haiku about rain."


def test_a_record_without_messages_is_one_line_naming_file_and_line(tmp_path):
    new, prior = tmp_path / "synth.jsonl", tmp_path / "synth0.jsonl"
    _write(new, [_record("a", "q", "a")])
    prior.write_text(json.dumps(_record("b", "q2", "a2")) + "\n" + json.dumps({"id": "c", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"synth0\.jsonl:2: field 'messages' must be a non-empty list"):
        merge_answers.merge(new, [prior])
    prior.write_text("\n" + json.dumps(_record("b", "q2", "a2")) + "\n{truncated\n")  # a blank line is no record
    with pytest.raises(ValueError, match=r"synth0\.jsonl:3: not a JSON record .*one object per line"):
        merge_answers.merge(new, [prior])


def test_unanswered_leaves_out_first_turns_a_prior_session_answered(tmp_path):
    """A ShareGPT prompt keeps the dataset's own answers and later turns; first-turn synth answers its first user
    turn only, so that is what is matched against the prior answers."""
    prompts, out, prior = tmp_path / "prompts.jsonl", tmp_path / "todo.jsonl", tmp_path / "synth0.jsonl"
    records = [_record("sharegpt-a_0", "what is chicken", "ChatGPT's answer", "and a duck?", "..."),
               _record("magpie-0000001", "Name three rivers."), _record("code-x@1-explain", "Explain `f`.")]
    _write(prompts, [{**r, "source": r["id"].split("-")[0]} for r in records])
    _write(prior, [_record("sharegpt-z_0", "what is chicken", "A bird."),  # same first turn, another id
                   _record("magpie-0000001", "Write a haiku about rain.", "Rain taps...")])  # same id only
    counts = merge_answers.unanswered(prompts, out, [prior])
    assert counts == {"prompts": 3, "kept": 2, "answered_before": 1, "answered_before_by_source": {"sharegpt": 1}}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["magpie-0000001", "code-x@1-explain"]
