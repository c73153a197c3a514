"""`hstap train` stops without losing a step and resumes only what it can continue:

- SIGTERM or SIGINT (HSTAP_FAULT `step-done:N:TERM`: the process signals itself after step N, no timer) writes the
  checkpoint of the step in flight and exits 143 / 130 in one line; `--resume` ends as the uninterrupted run.
  (Before: the process died of the signal, up to `--checkpoint-interval` of steps lost, `--resume` refused.)
- a loss or gradient turning NaN (a store poisoned with an inf state) stops the run naming the step; the last
  checkpoint is kept and no NaN reaches a checkpoint or metrics.jsonl. (Before: trained on, NaN everywhere, rc 0.)
- `--resume` refuses changed flags that decide what the run computes, naming each; applies and records a longer
  --max-steps (the schedule recomputed); says "already finished" for a finished run and writes nothing. (Before:
  --lr ignored, train_config.json kept the old values, each resume of a finished run appended an evaluation.)
- a fresh run that fails before its first checkpoint leaves nothing in --out. (Before: config.json and
  metrics.jsonl left, and the corrected command refused "--out is not empty".)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import hstap.faults as faults
from hstap.cli import main
from hstap.errors import HstapError
from hstap.train import checkpoint
from hstap.train.budget import WarmupCosine
from hstap.train.config import TrainConfig
from hstap.train.run import load_metrics, run_train

COMMON = dict(max_steps=4, batch_tokens=256, draft_vocab=2048, ttt_steps=2, heldout=0.1, seed=0, calib_prompts=0)


def _flags(**fields) -> list[str]:
    return [x for k, v in fields.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _trains(out: Path) -> list[dict]:
    return [r for r in load_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def loaded(target):
    """The session's target for every run of this module (each would load it again)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hstap.models.load_target", lambda *a, **k: target)
        yield target


@pytest.fixture(scope="module")
def straight(loaded, small_store, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The uninterrupted 4-step run the stopped and resumed ones must end as."""
    out = tmp_path_factory.mktemp("straight") / "run"
    result = run_train(TrainConfig(store=small_store, out=out, **COMMON), progress=False)
    return out, {k: v.clone() for k, v in result.drafter.trainable_state_dict().items()}


def test_sigterm_mid_run_checkpoints_the_step_in_flight_and_the_resume_ends_as_the_uninterrupted_run(
        straight, small_store, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = ["train", "--store", str(small_store), "--out", str(out), *_flags(**COMMON)]
    monkeypatch.setenv("HSTAP_FAULT", "step-done:2:TERM")  # SIGTERM arrives after step 2; step 3 is in flight
    faults.reset()
    assert main(argv) == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"hstap: stopped by SIGTERM: the checkpoint of step 3 is written in {out}; run the same command "
                    "with --resume to continue from it")
    assert checkpoint.read_meta(out)["step"] == 3 == _trains(out)[-1]["step"]  # no logged step is lost

    monkeypatch.delenv("HSTAP_FAULT")
    assert main([*argv, "--resume"]) == 0
    straight_out, weights = straight
    assert [r["step"] for r in _trains(out)] == [1, 2, 3, 4]
    # steps 1-3 and 4 ran in two calls of one process: fp32, the same kernels, equal to rounding
    torch.testing.assert_close(torch.tensor([r["loss"] for r in _trains(out)]),
                               torch.tensor([r["loss"] for r in _trains(straight_out)]), rtol=1e-6, atol=0)
    resumed = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["drafter"]
    for name, value in weights.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-7)


def test_sigint_at_the_last_step_checkpoints_it_and_exits_130(loaded, small_store, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("HSTAP_FAULT", "step-done:1:INT")  # Ctrl-C after step 1; step 2, the last, in flight
    faults.reset()
    assert main(["train", "--store", str(small_store), "--out", str(out), *_flags(**{**COMMON, "max_steps": 2})]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"hstap: stopped by SIGINT: the checkpoint of step 2 is written in {out}")
    assert checkpoint.read_meta(out)["step"] == 2 == _trains(out)[-1]["step"]
    assert not (out / "model.safetensors").exists()  # the resume evaluates and writes it


def _poison(store: Path, sample: str) -> None:
    """Set one sample's layer-1 states to inf and re-record the shard's checksum: a store whose bytes are whole
    (verify passes) but whose numbers are not, as a capture that overflowed fp16 would leave."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hstap.store.manifest import load_manifest, save_manifest

    manifest = load_manifest(store / "manifest.json")
    shard = next(s for s in manifest.shards if any(e.id == sample for e in s.samples))
    entry = next(e for e in shard.samples if e.id == sample)
    path = store / shard.file
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    first = f"hidden.{manifest.meta.layer_ids[0]}"
    tensors[first][entry.offset:entry.offset + entry.length] = float("inf")
    save_file(tensors, str(path), metadata=metadata)
    shard.sha256, shard.bytes = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size
    save_manifest(store / "manifest.json", manifest)


def test_a_loss_turning_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(loaded, small_store, tmp_path):
    from hstap.store import open_store
    from hstap.train.data import StoreSource, plan_batches, split_heldout

    store = tmp_path / "store"
    shutil.copytree(small_store, store)
    source = StoreSource(open_store(store))
    train_idx, _ = split_heldout(source.ids, COMMON["heldout"], COMMON["seed"])
    plan = plan_batches(train_idx, source.lengths, COMMON["batch_tokens"], COMMON["seed"], 0)
    _poison(store, source.ids[plan[2][0]])  # a sample of step 3's batch, and of no other step's
    out = tmp_path / "run"
    with pytest.raises(HstapError) as err:
        run_train(TrainConfig(store=store, out=out, checkpoint_every=1, **COMMON), progress=False)
    assert str(err.value).startswith("step 3: the loss turned nan (gradient norm nan); training stopped: the "
                                     "checkpoint of step 2 is kept (nothing after it written)"), err.value
    assert "\n" not in str(err.value)
    assert checkpoint.read_meta(out)["step"] == 2
    kept = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["drafter"]
    assert all(bool(torch.isfinite(t).all()) for t in kept.values() if t.is_floating_point())
    assert [r["step"] for r in _trains(out)] == [1, 2] and "NaN" not in (out / "metrics.jsonl").read_text()
    assert not (out / "model.safetensors").exists()


def test_resume_refuses_changed_flags_applies_a_longer_run_and_leaves_a_finished_one_alone(
        straight, small_store, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight[0], out)
    same = TrainConfig(store=small_store, out=out, resume=True, **COMMON)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    finished = run_train(same, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert finished.summary().startswith(
        f"hstap train: the run in {out} already finished at step 4; nothing to do, nothing written")

    with pytest.raises(HstapError) as err:
        run_train(same.model_copy(update={"lr": 3e-3, "warmup_ratio": 0.2, "batch_tokens": 512}), progress=False)
    assert str(err.value) == (
        f"--resume: the run in {out} was started with --lr 0.001, --warmup-ratio 0.05, --batch-tokens 256; this "
        "command gives --lr 0.003, --warmup-ratio 0.2, --batch-tokens 512: a resumed run continues that run, so pass "
        "its values (or start a new run: --init-from a finished run's directory keeps its weights)")

    longer = run_train(same.model_copy(update={"max_steps": 6}), progress=False)
    assert longer.steps == 6 and json.loads((out / "train_config.json").read_text())["max_steps"] == 6
    records = load_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 4, 6]  # the finished run's evaluation kept
    assert [r for r in records if r["kind"] == "resume"] == [
        {"kind": "resume", "step": 4, "total_steps": 6, "changed": {"max_steps": [4, 6]}}]
    # steps 5 and 6 follow the 6-step schedule (a record's lr is the next step's)
    schedule = WarmupCosine(6, TrainConfig.model_fields["warmup_ratio"].default)
    assert [r["lr"] for r in _trains(out)[4:]] == pytest.approx([COMMON_LR * schedule(k) for k in (5, 6)])
    assert run_train(same.model_copy(update={"max_steps": 6}), progress=False).already_finished


COMMON_LR = TrainConfig.model_fields["lr"].default


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_in_out(loaded, small_store, tmp_path):
    """A shard whose bytes changed is found at the first read of its states (the first held-out evaluation, after
    the run wrote config.json, train_config.json and metrics.jsonl): they go, and so does the --out it made."""
    from hstap.store import open_store
    from hstap.train.rundir import check_run_dir

    store = tmp_path / "store"
    shutil.copytree(small_store, store)
    shard = store / open_store(store).manifest.shards[0].file
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    out = tmp_path / "run"
    with pytest.raises(HstapError, match="sha256 mismatch"):
        run_train(TrainConfig(store=store, out=out, **COMMON), progress=False)
    assert not out.exists()
    check_run_dir(out, resume=False, overwrite=False)  # the corrected command is not refused
