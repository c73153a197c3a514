"""`capture-remote`'s writing side: announcing after a client was killed mid-append leaves only whole lines, which
the engine reads back in full."""

from __future__ import annotations

import json

from hstap.capture.engine_session import REQUESTS_NAME, Expected
from hstap.capture.remote import announce
from hstap.data import RenderedSample


def _sample(i: int, n: int = 3000) -> RenderedSample:
    return RenderedSample(id=f"s{i}", input_ids=[i] * n, loss_mask=[True] * n)  # ~20 kB a line: past any buffer


def test_announce_after_a_cut_line_leaves_only_whole_lines(tmp_path):
    announce(tmp_path, [_sample(0)])
    path = tmp_path / REQUESTS_NAME
    with open(path, "ab") as f:  # a client killed mid-append: half a line, no newline
        f.write(json.dumps({"id": "s9", "input_ids": [9] * 3000, "loss_mask": [True] * 3000}).encode()[:7000])
    announce(tmp_path, [_sample(1), _sample(2)])
    lines = path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["s0", "s1", "s2"]
    expected = Expected(path)
    assert expected.refresh() and sorted(expected.samples) == ["s0", "s1", "s2"]
    assert expected.whole([2] * 3000) == ["s2"]


def test_a_file_that_is_only_a_cut_line_is_emptied_first(tmp_path):
    (tmp_path / REQUESTS_NAME).write_text('{"id": "half')
    announce(tmp_path, [_sample(0, n=4)])
    assert [json.loads(x)["id"] for x in (tmp_path / REQUESTS_NAME).read_text().splitlines()] == ["s0"]
