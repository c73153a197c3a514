"""Crash loops for `hstap synth` (issue 13): SIGKILL at 20 seeded points — during the model load, mid-batch
(`decode-step`), after a whole record — then a re-run; and a really full disk (a 4 KB tmpfs). After each: whole
lines only, exactly the expected ids, no duplicates.

    HSTAP_RELIABILITY_LOOPS=1 HSTAP_RELIABILITY_OUT=loops.json python -m pytest -q -s tests/synth/test_crash_loops.py

Skipped without HSTAP_RELIABILITY_LOOPS=1 (~40 processes); the recorded figures are in docs/reliability-train.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.reliability import SEED, TRIALS, SmallDisk, hstap, killed, last_line, needs_loops, record

pytestmark = [needs_loops, pytest.mark.timeout(3600)]  # minutes of processes: past the 300 s default
QUESTIONS = ["What is the capital of France?", "Is the sky blue?", "Name a prime number.", "Say hello in Spanish.",
             "What is 2 + 2?", "Name one ocean.", "What color is grass?", "How many legs does a spider have?"]


def _questions(tmp_path: Path) -> Path:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{k}", "messages": [{"role": "user", "content": q}]}) + "\n"
                            for k, q in enumerate(QUESTIONS)))
    return data


def _whole_lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    assert not text or text.endswith("\n"), f"{path}: a cut-off last line"
    return [json.loads(line) for line in text.splitlines()]


def test_synth_killed_at_20_seeded_points_resumes_to_the_exact_set(tmp_path):
    data = _questions(tmp_path)
    args = lambda out: ("synth", "--model", "smollm2", "--data", f"jsonl:{data}", "--out", str(out),
                        "--max-new-tokens", "8", "--batch-size", "4")
    reference = tmp_path / "reference.jsonl"
    assert hstap(*args(reference)).returncode == 0
    expected = {r["id"]: r for r in _whole_lines(reference)}
    assert sorted(expected) == sorted(f"q{k}" for k in range(len(QUESTIONS)))

    rng = random.Random(SEED)
    trials, kills, equal = [], 0, 0
    for trial in range(TRIALS):
        point = ["model-load", "decode-step", "record-written"][trial % 3]
        count = {"model-load": 1, "decode-step": rng.randint(1, 14), "record-written": rng.randint(1, 7)}[point]
        out = tmp_path / f"t{trial}.jsonl"
        was_killed = killed(hstap(*args(out), fault=f"{point}:{count}"))
        kills += was_killed
        before = len(_whole_lines(out))
        done = hstap(*args(out))
        assert done.returncode == 0, done.stderr[-3000:]
        records = _whole_lines(out)
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"trial {trial}: duplicate ids"
        assert sorted(ids) == sorted(expected), f"trial {trial}: not the exact set"
        same = sum(r == expected[r["id"]] for r in records)
        equal += same == len(records)
        trials.append({"point": f"{point}:{count}", "killed": was_killed, "records_before_resume": before,
                       "records_equal_to_uninterrupted": same})
    record("synth", {"trials": TRIALS, "seed": SEED, "killed": kills, "exact_id_set": TRIALS, "duplicates": 0,
                     "cut_lines": 0, "runs_equal_to_uninterrupted": equal, "detail": trials})


def test_synth_into_a_really_full_disk_keeps_whole_lines_and_resumes(tmp_path):
    data = _questions(tmp_path)
    disk = SmallDisk(tmp_path / "small", "4k")  # one page: a few records, then ENOSPC part-way through a line
    try:
        out = disk.path / "o.jsonl"
        args = ("synth", "--model", "smollm2", "--data", f"jsonl:{data}", "--out", str(out), "--max-new-tokens",
                "48", "--batch-size", "4")
        full = hstap(*args)
        kept, error = _whole_lines(out), last_line(full)
        assert full.returncode == 2 and error.startswith("hstap: error:") and "No space left on device" in error
        disk.grow("1m")
        done = hstap(*args)
        assert done.returncode == 0, done.stderr[-2000:]
        ids = [r["id"] for r in _whole_lines(out)]
        assert sorted(ids) == sorted(f"q{k}" for k in range(len(QUESTIONS))) and len(ids) == len(set(ids))
        assert {r["id"] for r in kept} <= set(ids)
        record("synth_full_disk", {"stderr_last_line": error, "records_kept": len(kept),
                                   "records_after_resume": len(ids)})
    finally:
        disk.close()
