"""JsonlAppender: the crash-safe line writer shared by synth and prompts (SynthWriter's tests cover the tail cut)."""

from __future__ import annotations

import pytest

from hstap.data.appender import JsonlAppender
from hstap.errors import HstapError


def test_on_record_sees_every_whole_record_in_order(tmp_path):
    out = tmp_path / "p.jsonl"
    with JsonlAppender(out, "hstap prompts") as w:
        for i in range(3):
            w.write({"id": f"p{i}", "source": "code"})
    out.write_bytes(out.read_bytes() + b'{"id": "p3", "sou')  # a line cut by a kill
    seen: list[dict] = []
    with JsonlAppender(out, "hstap prompts", on_record=seen.append) as w:
        assert w.partial_bytes_removed == len(b'{"id": "p3", "sou')
        assert [r["id"] for r in seen] == ["p0", "p1", "p2"] and w.ids == {"p0", "p1", "p2"}


def test_errors_name_the_command(tmp_path):
    out = tmp_path / "p.jsonl"
    with JsonlAppender(out, "hstap prompts"):
        with pytest.raises(HstapError, match="another hstap prompts run"):
            JsonlAppender(out, "hstap prompts")
    out.write_text('{"id": "a"}\n[1]\n')
    with pytest.raises(HstapError, match=r"p.jsonl:2: not a record \(hstap prompts writes"):
        JsonlAppender(out, "hstap prompts")
