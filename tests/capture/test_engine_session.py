"""Engine capture's pure parts: packed positions split into requests, and the Matcher's identify/stitch/refuse rules."""

from __future__ import annotations

import json

import pytest
import torch

from hstap.capture.engine_session import HEAD, MAX_PARTIALS, Expected, Matcher, Span, split_by_positions

# ---- split_by_positions ----------------------------------------------------------------------------------------

# packed position ids -> (start, length, first position) per request, worked out by hand
LAYOUTS = [
    pytest.param([0, 1, 2, 3], [(0, 4, 0)], id="one-request"),
    pytest.param([0, 1, 2, 0, 1], [(0, 3, 0), (3, 2, 0)], id="two-requests"),
    pytest.param([0, 1, 0, 1, 2, 0], [(0, 2, 0), (2, 3, 0), (5, 1, 0)], id="three-requests-last-one-token"),
    pytest.param([5, 6, 7], [(0, 3, 5)], id="chunk-continuing-at-5"),
    pytest.param([0, 1, 2, 8, 9, 0], [(0, 3, 0), (3, 2, 8), (5, 1, 0)], id="new-then-continued-then-new"),
    pytest.param([0, 0, 0], [(0, 1, 0), (1, 1, 0), (2, 1, 0)], id="three-one-token-requests"),
    pytest.param([17, 4, 0, 1], [(0, 1, 17), (1, 1, 4), (2, 2, 0)], id="decode-rows-then-a-prefill"),
    pytest.param([3, 4, 5, 2, 3], [(0, 3, 3), (3, 2, 2)], id="second-chunk-restarts-lower"),
    pytest.param([9], [(0, 1, 9)], id="single-decode-row"),
    pytest.param([], [], id="empty-forward"),
]


@pytest.mark.parametrize("positions, expected", LAYOUTS)
def test_split_by_positions(positions, expected):
    assert split_by_positions(positions) == expected


# ---- Matcher ---------------------------------------------------------------------------------------------------

SYSTEM = list(range(1000, 1000 + HEAD))  # a shared system prompt, exactly HEAD tokens long
SAMPLES = {  # what the capture client announces in requests.jsonl
    "a": SYSTEM + [1, 2, 3, 4],
    "b": SYSTEM + [5, 6, 7, 8, 9, 10],
    "short": [7, 8, 9],
}
A, B = SAMPLES["a"], SAMPLES["b"]


def loss_mask(ids: list[int]) -> list[bool]:
    return [i < 1000 for i in ids]  # the answer tokens (< 1000) are trained on, the system prompt is not


def announce(path, names) -> None:
    with open(path, "a") as f:
        for name in names:
            f.write(json.dumps({"id": name, "input_ids": SAMPLES[name], "loss_mask": loss_mask(SAMPLES[name])}) + "\n")


def piece(ids: list[int], marker: float = 0.0) -> dict[str, torch.Tensor]:
    """One request's rows of a forward: each hidden row holds its token id (+ marker), so stitching is visible."""
    rows = torch.tensor(ids, dtype=torch.float32)[:, None] + marker  # (n, 1)
    return {"input_ids": torch.tensor(ids, dtype=torch.int64), "positions": torch.arange(len(ids)),
            "hidden.3": rows.expand(len(ids), 4).clone()}  # (n, 4)


class Recorder:
    def __init__(self):
        self.got: dict[str, dict[str, torch.Tensor]] = {}
        self.order: list[str] = []

    def __call__(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self.got[sample_id] = tensors
        self.order.append(sample_id)


def make_matcher(tmp_path, done=()) -> tuple[Matcher, Recorder]:
    path = tmp_path / "requests.jsonl"
    announce(path, SAMPLES)
    rec = Recorder()
    return Matcher(Expected(path), rec, set(done)), rec


def feed(matcher: Matcher, ids: list[int], prefix: int = 0, rid: str | None = None, marker: float = 0.0) -> None:
    matcher.feed(Span(start=0, length=len(ids), prefix=prefix, rid=rid), piece(ids, marker))


# (chunks fed in order as (token ids, prefix), samples emitted in order, counters)
TRAFFIC = [
    pytest.param([(A, 0)], ["a"], {"captured": 1}, id="whole-request"),
    pytest.param([(SAMPLES["short"], 0)], ["short"], {"captured": 1}, id="request-shorter-than-head"),
    pytest.param([(A[:HEAD], 0), (A[HEAD:], HEAD)], ["a"], {"captured": 1, "stitched": 1}, id="two-chunks"),
    pytest.param([(B[:HEAD], 0), (B[HEAD:19], HEAD), (B[19:], 19)], ["b"], {"captured": 1, "stitched": 1}, id="three-chunks"),
    pytest.param([(B[:18], 0), (B[18:], 18)], ["b"], {"captured": 1, "stitched": 1}, id="first-chunk-past-the-shared-prompt"),
    pytest.param([(SYSTEM, 0), (SYSTEM, 0), (B[HEAD:], HEAD), (A[HEAD:], HEAD)], ["b", "a"], {"captured": 2, "stitched": 2},
                 id="two-open-partials-on-one-system-prompt"),
    pytest.param([(A, 0), (B, 0)], ["a", "b"], {"captured": 2}, id="two-whole-requests"),
    pytest.param([([9, 9, 9], 0)], [], {"unmatched": 1}, id="foreign-traffic"),
    pytest.param([(list(range(40)), 0)], [], {"unmatched": 1}, id="foreign-long-prompt"),
    pytest.param([(A[HEAD:], HEAD)], [], {"refused_prefix_cached": 1}, id="continuation-of-nothing"),
    pytest.param([(A[:HEAD], 0), ([77, 78], HEAD)], [], {"refused_prefix_cached": 1},
                 id="continuation-fitting-no-candidate"),
    pytest.param([(A[:HEAD], 0), (A[HEAD + 1:], HEAD + 1)], [], {"refused_prefix_cached": 1},
                 id="continuation-at-the-wrong-prefix"),
    pytest.param([(A, 0), (A, 0)], ["a"], {"captured": 1, "duplicate": 1}, id="resent-whole-request"),
]


@pytest.mark.parametrize("chunks, emitted, counts", TRAFFIC)
def test_matcher_traffic(tmp_path, chunks, emitted, counts):
    matcher, rec = make_matcher(tmp_path)
    for ids, prefix in chunks:
        feed(matcher, ids, prefix)
    assert rec.order == emitted
    assert dict(matcher.counts) == counts
    for name in emitted:  # stitched rows in token order, the announced ids and mask, nothing else
        out = rec.got[name]
        assert set(out) == {"hidden.3", "input_ids", "loss_mask"}, "positions are not stored"
        assert out["hidden.3"][:, 0].tolist() == [float(t) for t in SAMPLES[name]]
        assert out["input_ids"].dtype == torch.int32 and out["input_ids"].tolist() == SAMPLES[name]
        assert out["loss_mask"].dtype == torch.bool and out["loss_mask"].tolist() == loss_mask(SAMPLES[name])


def test_already_committed_sample_is_a_duplicate(tmp_path):
    matcher, rec = make_matcher(tmp_path, done={"a"})
    feed(matcher, A)
    feed(matcher, B)
    assert rec.order == ["b"]
    assert dict(matcher.counts) == {"duplicate": 1, "captured": 1}


def test_request_id_routes_a_chunk_to_its_own_partial(tmp_path):
    """Two requests open with the same system prompt; the marker in their hidden rows shows whose rows were
    stitched: b's continuation (rid r2) must take r2's first chunk, not the older r1 partial that also fits."""
    matcher, rec = make_matcher(tmp_path)
    feed(matcher, SYSTEM, rid="r1", marker=0.25)
    feed(matcher, SYSTEM, rid="r2", marker=0.5)
    feed(matcher, B[HEAD:], prefix=HEAD, rid="r2", marker=0.5)
    feed(matcher, A[HEAD:], prefix=HEAD, rid="r1", marker=0.25)
    assert rec.order == ["b", "a"]
    assert rec.got["b"]["hidden.3"][:, 0].tolist() == [t + 0.5 for t in B]
    assert rec.got["a"]["hidden.3"][:, 0].tolist() == [t + 0.25 for t in A]


def test_without_request_ids_the_oldest_fitting_partial_continues(tmp_path):
    matcher, rec = make_matcher(tmp_path)
    feed(matcher, SYSTEM, marker=0.25)
    feed(matcher, SYSTEM, marker=0.5)
    feed(matcher, B[HEAD:], prefix=HEAD, marker=0.5)
    assert rec.got["b"]["hidden.3"][:HEAD, 0].tolist() == [t + 0.25 for t in SYSTEM]
    assert len(matcher.partials) == 1


def test_late_announcement_is_read_on_a_miss_whole_lines_only(tmp_path):
    path = tmp_path / "requests.jsonl"
    announce(path, ["a"])
    rec = Recorder()
    matcher = Matcher(Expected(path), rec, set())
    feed(matcher, A)
    line = json.dumps({"id": "b", "input_ids": B, "loss_mask": loss_mask(B)})
    with open(path, "a") as f:
        f.write(line[:25])  # the client is mid-write: half a line must not be parsed
    feed(matcher, B)
    assert rec.order == ["a"] and matcher.counts["unmatched"] == 1
    with open(path, "a") as f:
        f.write(line[25:] + "\n")
    feed(matcher, B)
    assert rec.order == ["a", "b"]
    assert dict(matcher.counts) == {"captured": 2, "unmatched": 1}


def test_missing_requests_file_matches_nothing(tmp_path):
    rec = Recorder()
    matcher = Matcher(Expected(tmp_path / "requests.jsonl"), rec, set())
    feed(matcher, A)
    assert rec.order == [] and dict(matcher.counts) == {"unmatched": 1}


def test_oldest_partial_is_abandoned_past_the_limit(tmp_path):
    matcher, rec = make_matcher(tmp_path)
    feed(matcher, SYSTEM, rid="first", marker=0.25)
    for i in range(MAX_PARTIALS):
        feed(matcher, SYSTEM, rid=f"r{i}")
    assert len(matcher.partials) == MAX_PARTIALS
    assert dict(matcher.counts) == {"abandoned_partial": 1}
    feed(matcher, A[HEAD:], prefix=HEAD, rid="first")
    assert dict(matcher.counts) == {"abandoned_partial": 1, "refused_prefix_cached": 1}, "its partial is gone"


def test_chunk_after_its_sample_completed_elsewhere_is_a_duplicate(tmp_path):
    """Two partials could become a; the first to complete emits it, the other one then counts as a duplicate."""
    matcher, rec = make_matcher(tmp_path)
    feed(matcher, A[:18], rid="r1")
    feed(matcher, A[:18], rid="r2")
    feed(matcher, A[18:], prefix=18, rid="r1")
    feed(matcher, A[18:], prefix=18, rid="r2")
    assert rec.order == ["a"]
    assert dict(matcher.counts) == {"captured": 1, "stitched": 1, "duplicate": 1}
    assert matcher.partials == []


def test_resent_chunked_sample_is_a_duplicate(tmp_path):
    matcher, rec = make_matcher(tmp_path)
    for _ in range(2):
        feed(matcher, A[:HEAD])
        feed(matcher, A[HEAD:], prefix=HEAD)
    assert rec.order == ["a"]
    assert dict(matcher.counts) == {"captured": 1, "stitched": 1, "duplicate": 1}
    assert matcher.partials == []


def test_first_chunk_shorter_than_head_is_stitched(tmp_path):
    matcher, rec = make_matcher(tmp_path)
    feed(matcher, B[:10])
    feed(matcher, B[10:], prefix=10)
    assert rec.order == ["b"]
    assert rec.got["b"]["hidden.3"][:, 0].tolist() == [float(t) for t in B]
    assert dict(matcher.counts) == {"captured": 1, "stitched": 1}
