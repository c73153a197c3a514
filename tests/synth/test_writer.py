"""SynthWriter: whole lines only, ids and prompt hashes read back, a cut-off tail removed, one writer per file."""

from __future__ import annotations

import json

import pytest

from hstap.errors import HstapError
from hstap.synth.writer import SynthWriter, failed_path


def _rec(i: int) -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i} é"}], "prompt_hash": f"h{i}"}


def test_append_and_read_back(tmp_path):
    out = tmp_path / "sub" / "o.jsonl"
    with SynthWriter(out, fsync_every=2) as w:
        for i in range(3):
            w.write(_rec(i))
    with SynthWriter(out) as w:
        assert w.ids == {"c0", "c1", "c2"} and w.prompt_hashes == {"h0", "h1", "h2"}
        assert w.partial_bytes_removed == 0
        w.write(_rec(3))
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["c0", "c1", "c2", "c3"]
    assert not failed_path(out).exists(), "no failures: no failed file left behind"


@pytest.mark.parametrize("tail", [b'{"id": "c9", "mess', b"{", b'{"id": "c9"}'])
def test_cut_off_last_line_is_removed_and_counted(tmp_path, tail):
    out = tmp_path / "o.jsonl"
    with SynthWriter(out) as w:
        w.write(_rec(0))
    whole = out.read_bytes()
    out.write_bytes(whole + tail)  # what a kill in the middle of a write leaves
    with SynthWriter(out) as w:
        assert w.partial_bytes_removed == len(tail)
        assert w.ids == {"c0"}
        w.write(_rec(1))
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["c0", "c1"]


def test_partial_only_line_leaves_an_empty_file(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "half')
    with SynthWriter(out) as w:
        assert w.partial_bytes_removed == 12 and w.ids == set()
    assert out.read_bytes() == b""


def test_failures_go_to_the_failed_file_of_this_run_only(tmp_path):
    out = tmp_path / "o.jsonl"
    with SynthWriter(out) as w:
        w.fail("c1", "HTTP 500", source="x")
        assert w.failed == 1
    assert json.loads(failed_path(out).read_text()) == {"id": "c1", "reason": "HTTP 500", "retry": True, "source": "x"}
    assert failed_path(out).name == "o.failed.jsonl"
    with SynthWriter(out) as w:
        w.write(_rec(1))
    assert not failed_path(out).exists(), "a re-run that retried them clears the old failures"


def test_corrupt_whole_line_is_a_one_line_error(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(HstapError, match=r"o.jsonl:2"):
        SynthWriter(out)


def test_second_writer_on_the_same_file_is_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    with SynthWriter(out):
        with pytest.raises(HstapError, match="another hstap synth"):
            SynthWriter(out)
