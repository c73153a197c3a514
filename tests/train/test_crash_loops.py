"""Crash loops for `hstap train` (issue 13): SIGKILL at 20 seeded points — mid-step (`train-batch`), after a step,
mid-checkpoint (before its files are written, and after, before the rename), during the model load — then
`--resume` (or `--overwrite` when no checkpoint was made yet, as the refusal says); and a really full disk (a tmpfs
one checkpoint fits in). Every resumed run must equal the uninterrupted one: losses and weights.

    HSTAP_RELIABILITY_LOOPS=1 HSTAP_RELIABILITY_OUT=loops.json python -m pytest -q -s tests/train/test_crash_loops.py

Skipped without HSTAP_RELIABILITY_LOOPS=1 (~40 processes); the recorded figures are in docs/reliability-train.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.reliability import SEED, TRIALS, SmallDisk, hstap, killed, last_line, needs_loops, record

pytestmark = [needs_loops, pytest.mark.timeout(3600)]  # minutes of processes: past the 300 s default


def _common(store: Path, steps: int) -> tuple[str, ...]:
    return ("--store", str(store), "--max-steps", str(steps), "--batch-tokens", "256", "--draft-vocab", "2048",
            "--ttt-steps", "2", "--heldout", "0.1", "--calib-prompts", "0", "--checkpoint-every", "2")


def _train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_train_killed_at_20_seeded_points_resumes_to_the_uninterrupted_run(small_store, tmp_path):
    common = _common(small_store, 5)
    reference = tmp_path / "reference"
    assert hstap("train", *common, "--out", str(reference)).returncode == 0
    ref_weights, ref_losses = load_file(str(reference / "model.safetensors")), \
        [r["loss"] for r in _train_records(reference)]

    rng = random.Random(SEED)
    trials, kills = [], 0
    points = ["train-batch", "step-done", "checkpoint-write", "checkpoint-written", "model-load"]
    for trial in range(TRIALS):
        point = points[trial % len(points)]
        count = {"train-batch": rng.randint(1, 5), "step-done": rng.randint(1, 4), "checkpoint-write": rng.randint(1, 3),
                 "checkpoint-written": rng.randint(1, 3), "model-load": 1}[point]
        out = tmp_path / f"t{trial}"
        was_killed = killed(hstap("train", *common, "--out", str(out), fault=f"{point}:{count}"))
        kills += was_killed
        how = "--resume" if (out / "checkpoint" / "trainer.pt").exists() else "--overwrite"
        if was_killed:
            done = hstap("train", *common, "--out", str(out), how)
            assert done.returncode == 0, done.stderr[-3000:]
        records = _train_records(out)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5], f"trial {trial}: each step once"
        losses, weights = [r["loss"] for r in records], load_file(str(out / "model.safetensors"))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7, msg=f"trial {trial}: {name}")
        exact = losses == ref_losses and all(torch.equal(weights[n], v) for n, v in ref_weights.items())
        trials.append({"point": f"{point}:{count}", "killed": was_killed, "resumed_with": how if was_killed else None,
                       "bitwise_equal": exact})
    record("train", {"trials": TRIALS, "seed": SEED, "killed": kills, "equal_to_uninterrupted": TRIALS,
                     "bitwise_equal": sum(t["bitwise_equal"] for t in trials), "detail": trials})


def test_train_into_a_really_full_disk_keeps_its_checkpoint_and_resumes(small_store, tmp_path):
    common = _common(small_store, 4)
    reference = tmp_path / "reference"
    assert hstap("train", *common, "--out", str(reference)).returncode == 0
    size = int(1.6 * (reference / "checkpoint" / "trainer.pt").stat().st_size)
    disk = SmallDisk(tmp_path / "small", str(size))  # one checkpoint fits; the next, written beside it, does not
    try:
        out = disk.path / "run"
        full = hstap("train", *common, "--out", str(out))
        error = last_line(full)
        assert full.returncode == 2 and error.startswith("hstap: error:") and "No space left on device" in error
        assert not (out / ".checkpoint.tmp").exists(), "the failed checkpoint's space is given back"
        disk.grow("400m")
        how = "--resume" if (out / "checkpoint" / "trainer.pt").exists() else "--overwrite"
        done = hstap("train", *common, "--out", str(out), how)
        assert done.returncode == 0, done.stderr[-2000:]
        losses = [r["loss"] for r in _train_records(out)]
        reference_losses = [r["loss"] for r in _train_records(reference)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-6, atol=0)
        record("train_full_disk", {"disk_bytes": size, "stderr_last_line": error, "resumed_with": how,
                                   "losses_equal": losses == reference_losses})
    finally:
        disk.close()
