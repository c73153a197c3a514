"""Training on real captured SmolLM2 states: it learns, resumes exactly, matches online, and refuses bad stores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstap.errors import HstapError
from hstap.train.config import TrainConfig
from hstap.train.run import load_metrics, run_train
from tests.conftest import SMALL_STORE

FAST = dict(draft_vocab=2048, ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0)
ROOT = Path(__file__).resolve().parents[2]


def _weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


def _cli_flags(**fields) -> list[str]:
    return [x for k, v in fields.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_killed_mid_checkpoint_then_disk_full_then_resumed_equals_uninterrupted(small_store, tmp_path, monkeypatch):
    """A real `hstap train` SIGKILLed between writing its 2nd checkpoint and renaming it (HSTAP_FAULT), refused as a
    run directory in use, resumed into a disk that fills at its next checkpoint (ENOSPC), resumed again: the losses
    and weights are the uninterrupted run's, metrics.jsonl holds each step once (no NUL padding), nothing is left
    half-written."""
    import hstap.faults as faults
    from hstap.train import checkpoint

    common = dict(max_steps=3, batch_tokens=256, **FAST)
    straight = run_train(TrainConfig(store=small_store, out=tmp_path / "a", **common), progress=False)
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "hstap.cli", "train", "--store", str(small_store), "--out", str(out),
           "--checkpoint-every", "1", *_cli_flags(**common)]
    killed = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HSTAP_FAULT": "checkpoint-written:2"},
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint.read_meta(out)["step"] == 1 and (out / ".checkpoint.tmp" / "trainer.pt").exists()

    again = TrainConfig(store=small_store, out=out, **common)
    with pytest.raises(HstapError, match="is not empty .*--resume.*--overwrite") as err:
        run_train(again, progress=False)  # before 2026-12 this silently started over, truncating the metrics
    assert "\n" not in str(err.value)

    resume = again.model_copy(update={"resume": True, "checkpoint_every": 1})
    monkeypatch.setenv("HSTAP_FAULT", "checkpoint-write:1:enospc")  # step 2's checkpoint does not land
    faults.reset()
    with pytest.raises(HstapError, match=r"No space left on device.* while writing the checkpoint of step 2; "
                                         r"the checkpoint of step 1 is kept: free space, then .* --resume") as err:
        run_train(resume, progress=False)
    assert "\n" not in str(err.value)
    assert checkpoint.read_meta(out)["step"] == 1 and not (out / ".checkpoint.tmp").exists()
    monkeypatch.delenv("HSTAP_FAULT")
    resumed = run_train(resume, progress=False)

    raw = (out / "metrics.jsonl").read_bytes()
    assert b"\0" not in raw
    losses = lambda run: [r["loss"] for r in load_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in load_metrics(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3]
    # step 1 ran in another process, 2 and 3 in this one: fp32, the same kernels, so equal to fp32 rounding
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(tmp_path / "a")), rtol=1e-6, atol=0)
    for name, value in _weights(straight.drafter).items():
        torch.testing.assert_close(resumed.drafter.trainable_state_dict()[name], value, rtol=1e-6, atol=1e-7)
    assert not any(p.name.startswith(".") or p.suffix == ".tmp" for p in out.iterdir())


def test_metrics_of_another_length_are_cut_to_the_checkpoint_step_never_padded(tmp_path, capsys):
    """The NUL padding of 2026-11: a checkpoint recorded a metrics size larger than the file (its run directory
    had been started over), and truncate() extended the file with NUL bytes. Now the file is never extended: its
    whole records up to the checkpoint's step are kept, NUL-padded lines repaired, the rest dropped and said."""
    from hstap.train.checkpoint import cut_metrics

    rec = lambda step: json.dumps({"kind": "train", "step": step, "loss": 1.0 / step}) + "\n"
    path = tmp_path / "metrics.jsonl"
    path.write_bytes((rec(1) + rec(2)).encode() + b"\0" * 4096 + (rec(3) + rec(4)).encode() + b'{"kind": "tr')
    cut_metrics(path, 9000, step=3)
    assert path.read_text() == rec(1) + rec(2) + rec(3)
    assert "kept its 3 whole records up to step 3, dropped 2 lines" in capsys.readouterr().err
    whole = path.read_bytes()
    cut_metrics(path, len(rec(1)), step=1)  # the usual case: cut at the byte offset the checkpoint recorded
    assert path.read_text() == rec(1) and capsys.readouterr().err == ""
    cut_metrics(path, len(whole), step=3)  # a size past the end never pads
    assert path.read_text() == rec(1)


def test_a_kill_between_the_checkpoint_renames_keeps_a_checkpoint(tmp_path):
    """Killed after the old checkpoint was moved aside and before the new one was renamed into place: the whole
    new one is put in place (its meta.json is written last); without it, the old one."""
    from hstap.train import checkpoint

    for new_whole, expected in ((True, "new"), (False, "old")):
        out = tmp_path / expected
        for name, tag in ((".checkpoint.old", "old"), (".checkpoint.tmp", "new")):
            (out / name).mkdir(parents=True)
            (out / name / "trainer.pt").write_text(tag)
        if new_whole:
            (out / ".checkpoint.tmp" / "meta.json").write_text('{"step": 4, "metrics_bytes": 0}')
        assert checkpoint.exists(out) and (out / "checkpoint" / "trainer.pt").read_text() == expected


def test_checkpoints_come_on_a_clock_by_default_and_on_steps_when_asked():
    from hstap.train.rundir import CheckpointClock

    assert TrainConfig(store="s", out="o").checkpoint_interval_s == 300 and TrainConfig(store="s", out="o").\
        checkpoint_every is None  # a short run is never lost for want of step 200
    now = {"t": 0.0}
    clock = CheckpointClock(None, 300, clock=lambda: now["t"])
    due = []
    for step in range(1, 9):
        now["t"] += 100  # 100 s per step
        if clock.due(step):
            due.append(step)
            clock.saved()
    assert due == [3, 6]
    steps = CheckpointClock(4, 1e9, clock=lambda: 0.0)
    assert [s for s in range(1, 10) if steps.due(s)] == [4, 8]


def test_online_training_matches_offline(small_store, tmp_path):
    """Three steps online equal three steps on the store of the same conversations. The property is the equality
    of two paths, not their size: batches of 512 tokens and 2 held-out conversations (online, each one is a
    forward of the target) instead of 1,024 and 4 (-6 s of a core)."""
    common = dict(max_steps=3, batch_tokens=512, **{**FAST, "heldout": 0.05})
    offline = run_train(TrainConfig(store=small_store, out=tmp_path / "off", **common), progress=False)
    online = run_train(TrainConfig(online=True, data="sharegpt", **SMALL_STORE, out=tmp_path / "on", **common),
                       progress=False)
    loss = lambda out: [r["loss"] for r in load_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert torch.equal(offline.drafter.d2t, online.drafter.d2t)
    # same samples, same batches; only the prefill batch shapes differ (fp32 summation order, then bf16 rounding)
    torch.testing.assert_close(torch.tensor(loss(tmp_path / "on")), torch.tensor(loss(tmp_path / "off")),
                               rtol=2e-3, atol=0)
    for name, value in _weights(offline.drafter).items():
        torch.testing.assert_close(online.drafter.trainable_state_dict()[name], value, rtol=0, atol=2e-4)


def _edit_manifest(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["meta"].__setitem__("model_fingerprint", "0000"), "fingerprint"),
    (lambda m: m["meta"].__setitem__("hidden_size", 4096), "hidden_size=4096"),
    (lambda m: [m["tensors"].pop(k) for k in ("teacher.topk_ids", "teacher.topk_logprobs")], "teacher.topk_ids"),
])
def test_mismatched_store_is_a_one_line_error(small_store, tmp_path, edit, needle):
    bad = _edit_manifest(small_store, tmp_path / "bad", edit)
    with pytest.raises(HstapError, match=needle) as err:
        run_train(TrainConfig(store=bad, out=tmp_path / "out", **FAST), progress=False)
    assert "\n" not in str(err.value)


def test_empty_store_and_resume_layer_mismatch(small_store, tmp_path):
    from hstap.store import StoreWriter, open_store

    meta = open_store(small_store).manifest.meta
    StoreWriter(tmp_path / "empty", meta).close()
    with pytest.raises(HstapError, match="empty"):
        run_train(TrainConfig(store=tmp_path / "empty", out=tmp_path / "o1", **FAST), progress=False)

    out = tmp_path / "o2"
    out.mkdir()
    cfg_json = json.loads(json.dumps(dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        vocab_size=49152, draft_vocab_size=2048, aux_layer_ids=[2, 14, 26], target_model_id="x",
        target_fingerprint=meta.model_fingerprint, target_num_layers=30, target_hidden_size=576)))
    (out / "config.json").write_text(json.dumps(cfg_json))
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "trainer.pt").write_bytes(b"")  # never read: the drafter's layers are checked first
    with pytest.raises(HstapError, match=r"aux_layer_ids=\[2, 14, 26\]"):
        run_train(TrainConfig(store=small_store, out=out, resume=True, **FAST), progress=False)


# The budget tests run on a fake clock: what they check (the probe, the fit, the schedule) counts steps, not
# their cost, so one drafting step per training step proves it as well as FAST's three, at a fraction of the work.
ON_A_FAKE_CLOCK = {**FAST, "ttt_steps": 1}


def _batch_clock(monkeypatch) -> dict[str, float]:
    """The trainer's clock made fake: it stands still except for one second per batch fetched."""
    import hstap.train.budget as budget_module
    import hstap.train.trainer as trainer_module

    clock = {"t": 0.0}
    real_load = trainer_module.load_batch

    def load_tick(*args, **kw):
        clock["t"] += 1.0
        return real_load(*args, **kw)

    monkeypatch.setattr(budget_module, "load_batch", load_tick)  # the probe's batches
    monkeypatch.setattr(trainer_module, "load_batch", load_tick)  # the steps'
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: clock["t"])
    return clock


def test_time_budget_rescales_the_schedule_and_resumes_with_it(small_store, tmp_path, monkeypatch):
    """A fake clock (one second per batch fetched): the probe fits the run to the budget before step 1, the
    schedule warms up and reaches zero at the fitted end, and a resumed run keeps the fitted schedule."""
    _batch_clock(monkeypatch)
    budget = 30  # the probe's batches (at most 13), then one-second steps
    cfg = TrainConfig(store=small_store, out=tmp_path / "run", epochs=50, batch_tokens=256, time_budget_s=budget,
                      checkpoint_every=1000, **ON_A_FAKE_CLOCK)
    result = run_train(cfg, progress=False)
    records = load_metrics(tmp_path / "run" / "metrics.jsonl")
    fitted = [r for r in records if r["kind"] == "budget"]
    assert len(fitted) == 1 and fitted[0]["seconds_per_step"] == 1.0
    steps = budget - fitted[0]["probe_steps"]  # every fetch ticks one second: what the probe left of the budget
    assert fitted[0]["total_steps"] == steps and 17 <= steps <= 29 and result.steps == steps
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(cfg.lr)  # warmed up and decayed fully
    assert [r for r in records if r["kind"] == "eval"][-1]["step"] == steps  # judged where it stopped

    more = cfg.model_copy(update={"resume": True})  # the checkpoint holds the fitted total: nothing left to do
    assert run_train(more, progress=False).steps == steps


def test_a_budgeted_run_refits_to_the_steps_it_times(small_store, tmp_path, monkeypatch):
    """A probe that times 4 s a step where steps then take 1 s (a fake clock, one second per batch fetched; on an
    H200 on 2026-12-03, 0.73 s against 0.22 s): the run re-fits its step count to the steps it has timed and
    fills the budget instead of stopping at a quarter of it, with the schedule decayed to zero at the new end."""
    clock = _batch_clock(monkeypatch)
    monkeypatch.setattr("hstap.train.budget.seconds_per_step", lambda *a, **kw: 4.0)
    monkeypatch.setattr("hstap.train.budget.REFIT_EVERY", 2)
    budget = 16
    cfg = TrainConfig(store=small_store, out=tmp_path / "run", epochs=50, batch_tokens=256, time_budget_s=budget,
                      checkpoint_every=1000, **ON_A_FAKE_CLOCK)
    result = run_train(cfg, progress=False)
    records = load_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["total_steps"] for r in records if r["kind"] == "budget"] == [budget // 4]  # the probe's fit
    assert [r for r in records if r["kind"] == "budget_refit"][0]["seconds_per_step"] == 1.0
    assert result.steps == budget and clock["t"] == budget  # the whole budget, one second a step
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(cfg.lr)


def test_a_budgeted_run_resumed_after_a_stop_fits_the_rest_into_what_is_left(small_store, tmp_path, monkeypatch):
    """Steps of 2 s (a fake clock: each batch fetched ticks it) until a SIGTERM after step 3 checkpoints step 4
    (8 s of a 24-s budget spent, fitted to 12 steps), then 1-s steps once resumed: the resumed run goes on
    refitting to the steps it times and ends when the budget does (step 20), its schedule decayed to zero there.
    Kept frozen at the fit the stop left (as before 2026-12-06, measured on an H100: 1,030 steps of a 7-minute
    budget's ~3,700), it would end at step 12 with half the budget unspent."""
    import hstap.faults as faults
    import hstap.train.budget as budget_module
    import hstap.train.trainer as trainer_module
    from hstap.errors import Interrupted
    from hstap.train import checkpoint

    clock = {"t": 0.0, "tick": 2.0}
    real_load = trainer_module.load_batch

    def load_tick(*args, **kw):
        clock["t"] += clock["tick"]
        return real_load(*args, **kw)

    monkeypatch.setattr(trainer_module, "load_batch", load_tick)
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(budget_module, "seconds_per_step", lambda *a, **kw: 2.0)
    monkeypatch.setattr(budget_module, "REFIT_EVERY", 2)
    cfg = TrainConfig(store=small_store, out=tmp_path / "run", epochs=50, batch_tokens=256, time_budget_s=24,
                      checkpoint_every=1000, **ON_A_FAKE_CLOCK)
    monkeypatch.setenv("HSTAP_FAULT", "step-done:3:TERM")  # step 4 in flight: its checkpoint is the stop's
    faults.reset()
    with pytest.raises(Interrupted):
        run_train(cfg, progress=False)
    monkeypatch.delenv("HSTAP_FAULT")
    assert checkpoint.read_meta(tmp_path / "run")["step"] == 4 and clock["t"] == 8.0

    clock["tick"] = 1.0
    result = run_train(cfg.model_copy(update={"resume": True}), progress=False)
    records = load_metrics(tmp_path / "run" / "metrics.jsonl")
    resumed = [r for r in records if r["kind"] == "budget_resumed"]
    assert resumed == [{"kind": "budget_resumed", "step": 4, "spent_s": 8.0, "total_steps": 12}]
    assert result.steps == 20 and clock["t"] == 24.0  # the whole budget: 8 s before the stop, 16 one-second steps
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    assert lrs[-1] == 0.0


def test_init_from_continues_an_earlier_drafter(small_store, tmp_path):
    """`--init-from` starts where an earlier run (another device session, a smaller set) ended: its weights and
    its draft vocabulary, loaded from the bf16 copy without the embedding that travels between machines. Batches of
    256 tokens: the property is what is loaded, not how much the first run learned."""
    first = run_train(TrainConfig(store=small_store, out=tmp_path / "a", max_steps=3, batch_tokens=256, **FAST),
                      progress=False)
    shipped = first.drafter.to(torch.bfloat16)
    shipped.save_pretrained(tmp_path / "shipped", include_embedding=False)
    # --draft-vocab unset, whose CPU default (8,192) is not the first run's 2,048: the drafter keeps its vocabulary
    # one step at a vanishing learning rate: what it started from, the shipped weights
    unset = {k: v for k, v in FAST.items() if k != "draft_vocab"}
    again = run_train(TrainConfig(store=small_store, out=tmp_path / "b", max_steps=1, batch_tokens=256, lr=1e-12,
                                  init_from=tmp_path / "shipped", **unset), progress=False)
    assert torch.equal(again.drafter.d2t, first.drafter.d2t)
    assert json.loads((tmp_path / "b" / "train_config.json").read_text())["draft_vocab"] == FAST["draft_vocab"]
    for name, value in shipped.trainable_state_dict().items():
        expected = value.float() if value.is_floating_point() else value  # d2t, t2d: exact
        torch.testing.assert_close(again.drafter.trainable_state_dict()[name].cpu(), expected, rtol=0, atol=1e-9)

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "shipped", other)
    cfg_json = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg_json, "aux_layer_ids": [2, 14, 26]}))
    with pytest.raises(HstapError, match=r"--init-from: drafter in .* has aux_layer_ids=\[2, 14, 26\]"):
        run_train(TrainConfig(store=small_store, out=tmp_path / "c", init_from=other, **FAST), progress=False)


def test_online_loops_cut_trains_on_the_cut_samples_and_says_so(target, tmp_path, capsys):
    """`--loops cut` reaches the online trainer: a conversation whose answer loops is shorter by the loop and its
    end of turn, the other is unchanged, and the count is printed before training."""
    from hstap.train.build import open_source

    sentence = "I'm here to help you with your project, and I'm happy to share my expertise with you. "
    rows = [{"id": "loops", "messages": [{"role": "user", "content": "Can you help me with my project?"},
                                         {"role": "assistant", "content": sentence * 12}]},
            {"id": "plain", "messages": [{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": "Blue."}]}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = {}
    for loops in ("keep", "cut"):
        cfg = TrainConfig(online=True, data=f"jsonl:{data}", out=tmp_path / loops, loops=loops, **FAST)
        source, _, _ = open_source(cfg.sized_for_device(), target, torch.device("cpu"))
        lengths[loops] = source.lengths
    per_period = len(target.tokenizer(sentence, add_special_tokens=False)["input_ids"])
    assert lengths["cut"][1] == lengths["keep"][1]
    assert lengths["keep"][0] - lengths["cut"][0] >= 9 * per_period  # 12 sentences, 2 kept (one more may merge)
    assert "loop_cut 1; loop_tokens_cut" in capsys.readouterr().out


def test_loss_on_all_reaches_the_trainer_and_refuses_cut_loops(small_store, tmp_path):
    """`--loss-on all` changes the trained loss (the same seed and batch, more positions counted) while the
    held-out figures stay on answers; with loop tails cut out of the loss (online `--loops cut`, or a store captured
    so) it is a one-line error, the online one before any model loads."""
    from hstap.train import rundir

    common = dict(store=small_store, max_steps=1, batch_tokens=256, **FAST)
    runs = {on: run_train(TrainConfig(out=tmp_path / on, loss_on=on, **common), progress=False)
            for on in ("answers", "all")}
    first = {on: next(r for r in load_metrics(tmp_path / on / "metrics.jsonl") if r["kind"] == "train")["loss"]
             for on in runs}
    assert first["all"] != first["answers"]
    assert runs["all"].initial_heldout == runs["answers"].initial_heldout  # the same untrained drafter, on answers

    online = TrainConfig(online=True, loops="cut", loss_on="all", out=tmp_path / "o", **FAST)
    with pytest.raises(HstapError, match=r"--loss-on all would count the loop tails that --loops cut") as err:
        rundir.preflight(online)
    assert "\n" not in str(err.value)
    cut = _edit_manifest(small_store, tmp_path / "cut", lambda m: m["meta"]["extra"].__setitem__("loops", "cut"))
    with pytest.raises(HstapError, match=r"store .*cut \(--loops cut\) took out of the loss.*--loss-on answers"):
        run_train(TrainConfig(store=cut, out=tmp_path / "c", loss_on="all", **FAST), progress=False)
    run_train(TrainConfig(store=cut, out=tmp_path / "c2", max_steps=1, batch_tokens=256, **FAST), progress=False)


def test_summary_says_when_nothing_was_held_out(tmp_path):
    """16 samples at --heldout 0.05 hold none out: the summary says so instead of printing `nan → nan`."""
    from hstap.train.run import TrainResult

    text = TrainResult(out=tmp_path, steps=2, train_tokens=100, seconds=1.0, heldout={}, initial_heldout={}).summary()
    assert "held-out: none" in text and "nan" not in text


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_zero_prints_the_summary(tmp_path, monkeypatch, capsys, rank):
    """Under torchrun every rank returns from run_train; one summary is printed, by the rank that wrote the run."""
    import hstap.train.run as run_module
    from hstap.train import cli
    from hstap.train.run import TrainResult

    done = TrainResult(out=tmp_path, steps=2, train_tokens=100, seconds=1.0, heldout={}, initial_heldout={})
    monkeypatch.setattr(run_module, "run_train", lambda cfg: done)
    monkeypatch.setenv("RANK", rank)
    assert cli.run(TrainConfig(store=tmp_path, out=tmp_path / "run")) == 0
    assert capsys.readouterr().out.count("trained 2 steps") == (rank == "0")
