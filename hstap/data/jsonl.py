"""Conversations from a JSONL file in the OpenAI chat format: one `{"id": str, "messages": [...]}` per line.

Structural errors (a line that is not UTF-8 or not JSON, no `messages` list, a non-string role or content, no id)
raise HstapError naming `path:line` and the field, since they mean the file is not what the user thinks it is.
Content problems (empty turns, unknown roles, roles out of order, text that is not valid Unicode such as a lone
surrogate `\ud800`) skip the record and count it in the report, by the same rules as ShareGPT. Blank lines are
not records and are passed over.

A record's optional `meta` object and its `source` and `category` strings (what `hstap prompts` writes) are kept
in `Conversation.meta` (the `meta` object's own keys winning), so `hstap synth` carries them into its output and
results can be grouped by where a prompt came from.

    from hstap.data import iter_jsonl
    for conv in iter_jsonl("prompts.jsonl"): ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from hstap.data.checks import message_problem
from hstap.data.types import Conversation, SkipReport
from hstap.errors import HstapError


def iter_jsonl(path: Path | str, report: SkipReport | None = None) -> Iterator[Conversation]:
    """Valid conversations from `path`; a repeated id keeps the first record and counts `duplicate_id`."""
    path = Path(path)
    if not path.is_file():
        raise HstapError(f"{path}: file not found (expected a JSONL file of {{'id', 'messages'}} records)")
    return _iter_records(path, report)  # checked above, eagerly: a generator would only fail on first next()


def _iter_records(path: Path, report: SkipReport | None) -> Iterator[Conversation]:
    seen: set[str] = set()
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by its number, not a codec traceback
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, f"{path}:{lineno}", bom=lineno == 1)
            if not line.strip():
                continue
            conv_id, messages, meta = _parse_line(line, f"{path}:{lineno}")
            reason = message_problem(messages) or _unicode_problem(line, conv_id, messages, meta)
            if reason is None and conv_id in seen:
                reason = "duplicate_id"
            if reason is not None:
                if report is not None:
                    report.add(reason, where=f"{path}:{lineno}")
                continue
            seen.add(conv_id)
            yield Conversation(id=conv_id, messages=messages, source=str(path), meta=meta)


def _decode(raw: bytes, where: str, bom: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if bom else "utf-8")  # a byte-order mark on line 1 is not part of the JSON
    except UnicodeDecodeError as e:
        raise HstapError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                         "re-encode the file as UTF-8") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _unicode_problem(line: str, conv_id: str, messages: list[dict[str, str]], meta: dict) -> str | None:
    """`invalid_unicode` when the record's text cannot be written back as UTF-8: a lone surrogate from a `\\ud800`
    escape, which JSON allows but no later stage (tokenizer, output file) can take."""
    if not _SURROGATE_ESCAPE.search(line):  # only an escape can make one: skip the re-encoding otherwise
        return None
    try:
        json.dumps([conv_id, messages, meta], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_unicode"
    return None


def _parse_line(line: str, where: str) -> tuple[str, list[dict[str, str]], dict[str, object]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise HstapError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise HstapError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not isinstance(record.get("id"), str) or not record["id"]:
        raise HstapError(f"{where}: field 'id' must be a non-empty string, got {record.get('id')!r}")
    raw = record.get("messages")
    if not isinstance(raw, list):
        raise HstapError(f"{where}: field 'messages' must be a list of {{'role', 'content'}} objects, "
                         f"got {type(raw).__name__ if raw is not None else 'nothing'}")
    messages = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict):
            raise HstapError(f"{where}: field 'messages[{k}]' must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise HstapError(f"{where}: field 'messages[{k}].{key}' must be a string, got {m.get(key)!r}")
        messages.append({"role": m["role"], "content": m["content"]})
    return record["id"], messages, _meta(record, where)


def _meta(record: dict, where: str) -> dict[str, object]:
    meta = record.get("meta", {})
    if not isinstance(meta, dict):
        raise HstapError(f"{where}: field 'meta' must be an object, got {type(meta).__name__}")
    meta = dict(meta)
    for key in ("source", "category"):
        if key in record:
            if not isinstance(record[key], str):
                raise HstapError(f"{where}: field '{key}' must be a string, got {record[key]!r}")
            # synth output names its input file as `source` and keeps the prompt's own source in `meta`
            meta.setdefault(key, record[key])
    return meta
