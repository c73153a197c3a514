"""bench/merge_answers.py: an earlier session's answers join this session's by prompt content, not by record id
(another prompt seed reuses Magpie and code ids for different prompts)."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import bench_script


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
    counts = bench_script("merge_answers").merge(new, [prior])
    assert counts == {"this_session": 2, "prior_added": 2, "prior_answered_again": 2}
    kept = [json.loads(line) for line in new.read_text().splitlines()]
    assert [r["id"] for r in kept] == ["magpie-0000001", "sharegpt-a_0", "magpie-0000001", "sharegpt-c_1"]
    assert kept[2]["messages"][0]["content"] == "Write a haiku about rain."


def test_a_record_without_messages_is_one_line_naming_file_and_line(tmp_path):
    new, prior = tmp_path / "synth.jsonl", tmp_path / "synth0.jsonl"
    _write(new, [_record("a", "q", "a")])
    prior.write_text(json.dumps(_record("b", "q2", "a2")) + "\n" + json.dumps({"id": "c", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"synth0\.jsonl:2: field 'messages' must be a non-empty list"):
        bench_script("merge_answers").merge(new, [prior])
