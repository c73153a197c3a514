"""Training on real captured SmolLM2 states: it learns, resumes exactly, matches online, and refuses bad stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hstap.drafter import Eagle3Drafter
from hstap.errors import HstapError
from hstap.train.config import TrainConfig
from hstap.train.run import load_metrics, run_train

FAST = dict(draft_vocab=2048, ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0)


def _weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


@pytest.fixture(scope="module")
def trained(train_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "run"
    cfg = TrainConfig(store=train_store, out=out, epochs=2, lr=3e-3, batch_tokens=2048, **FAST)
    return run_train(cfg, progress=False)


def test_training_lowers_heldout_loss_and_lifts_step0_accuracy(trained):
    before, after = trained.initial_heldout, trained.heldout
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, step-0 acc {before['acc'][0]:.3f} -> "
          f"{after['acc'][0]:.3f}, tau_est {after['tau_est']}")
    assert after["loss"] < before["loss"] * 0.75  # measured 18.8 -> 12.8
    assert before["acc"][0] < 0.02  # untrained: chance level over a 2048-token draft vocabulary
    assert after["acc"][0] > 0.15  # measured 0.205 (2026-11-29)
    assert after["tau_est"][1] > 1.12  # measured 1.20


def test_run_directory_contents(trained):
    out = trained.out
    for name in ["config.json", "model.safetensors", "train_config.json", "metrics.jsonl", "loss.png",
                 "accuracy.png", "tau_estimate.png", "checkpoint/trainer.pt"]:
        assert (out / name).exists(), name
    records = load_metrics(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    assert set(evals[-1]["tau_est"]) == {"1", "2", "3"} and len(evals[-1]["acc"]) == 3
    assert sum(r["kind"] == "train" for r in records) == trained.steps
    config = json.loads((out / "config.json").read_text())
    assert config["aux_layer_ids"] == [1, 14, 26] and config["draft_vocab_size"] == 2048


def test_saved_drafter_reloads_with_the_target_embedding(trained, target):
    again = Eagle3Drafter.from_pretrained(trained.out)
    for name, value in _weights(trained.drafter).items():
        assert torch.equal(again.state_dict()[name], value), name
    assert torch.equal(again.embed_tokens.weight, target.model.get_input_embeddings().weight)


def test_resume_continues_exactly(train_store, tmp_path, monkeypatch):
    import hstap.train.run as run_module

    def cfg(out, resume=False):
        return TrainConfig(store=train_store, out=out, max_steps=4, checkpoint_every=2, batch_tokens=768,
                           resume=resume, **FAST)

    straight = run_train(cfg(tmp_path / "a"), progress=False)
    real_load, calls = run_module.load_batch, {"n": 0}

    def crash_on_third(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash before step 3")
        return real_load(*args, **kw)

    monkeypatch.setattr(run_module, "load_batch", crash_on_third)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_train(cfg(tmp_path / "b"), progress=False)
    monkeypatch.setattr(run_module, "load_batch", real_load)
    resumed = run_train(cfg(tmp_path / "b", resume=True), progress=False)

    losses = lambda out: [r["loss"] for r in load_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # steps 3-4 replayed bit for bit, 1-2 not duplicated
    for name, value in _weights(straight.drafter).items():
        assert torch.equal(resumed.drafter.trainable_state_dict()[name], value), name


def test_online_training_matches_offline(train_store, tmp_path):
    common = dict(max_steps=3, batch_tokens=1024, **FAST)
    offline = run_train(TrainConfig(store=train_store, out=tmp_path / "off", **common), progress=False)
    online = run_train(TrainConfig(online=True, data="sharegpt", limit=240, max_tokens=128, out=tmp_path / "on",
                                   **common), progress=False)
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
def test_mismatched_store_is_a_one_line_error(train_store, tmp_path, edit, needle):
    bad = _edit_manifest(train_store, tmp_path / "bad", edit)
    with pytest.raises(HstapError, match=needle) as err:
        run_train(TrainConfig(store=bad, out=tmp_path / "out", **FAST), progress=False)
    assert "\n" not in str(err.value)


def test_empty_store_and_resume_layer_mismatch(train_store, tmp_path):
    from hstap.store import StoreWriter, open_store

    meta = open_store(train_store).manifest.meta
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
    with pytest.raises(HstapError, match=r"aux_layer_ids=\[2, 14, 26\]"):
        run_train(TrainConfig(store=train_store, out=out, resume=True, **FAST), progress=False)


def test_time_budget_rescales_the_schedule_and_resumes_with_it(train_store, tmp_path, monkeypatch):
    """A fake clock (one second per batch fetched): the probe fits the run to the budget before step 1, the
    schedule warms up and reaches zero at the fitted end, and a resumed run keeps the fitted schedule."""
    import hstap.train.run as run_module
    from hstap.train.run import PROBE_SKIP, PROBE_STEPS

    clock = {"t": 0.0}
    real_load = run_module.load_batch

    def load_tick(*args, **kw):
        clock["t"] += 1.0
        return real_load(*args, **kw)

    monkeypatch.setattr(run_module, "load_batch", load_tick)
    monkeypatch.setattr(run_module.time, "perf_counter", lambda: clock["t"])
    budget = PROBE_SKIP + PROBE_STEPS + 40  # the probe's batches, then 40 one-second steps
    cfg = TrainConfig(store=train_store, out=tmp_path / "run", epochs=50, batch_tokens=512, time_budget_s=budget,
                      checkpoint_every=1000, **FAST)
    result = run_train(cfg, progress=False)
    records = load_metrics(tmp_path / "run" / "metrics.jsonl")
    fitted = [r for r in records if r["kind"] == "budget"]
    assert len(fitted) == 1 and fitted[0]["seconds_per_step"] == 1.0 and fitted[0]["total_steps"] == 40
    assert result.steps == 40
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(cfg.lr)  # warmed up and decayed fully

    more = cfg.model_copy(update={"resume": True})  # the checkpoint holds the fitted total: nothing left to do
    assert run_train(more, progress=False).steps == 40
