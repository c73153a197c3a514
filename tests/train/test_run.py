"""Training on real captured SmolLM2 states: it learns, resumes exactly, matches online, and refuses bad stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hstap.errors import HstapError
from hstap.train.config import TrainConfig
from hstap.train.run import load_metrics, run_train
from tests.conftest import SMALL_STORE

FAST = dict(draft_vocab=2048, ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0)


def _weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


def test_resume_continues_exactly(small_store, tmp_path, monkeypatch):
    import hstap.train.run as run_module

    def cfg(out, resume=False):
        return TrainConfig(store=small_store, out=out, max_steps=4, checkpoint_every=2, batch_tokens=768,
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


def test_online_training_matches_offline(small_store, tmp_path):
    common = dict(max_steps=3, batch_tokens=1024, **FAST)
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
    with pytest.raises(HstapError, match=r"aux_layer_ids=\[2, 14, 26\]"):
        run_train(TrainConfig(store=small_store, out=out, resume=True, **FAST), progress=False)


def test_time_budget_rescales_the_schedule_and_resumes_with_it(small_store, tmp_path, monkeypatch):
    """A fake clock (one second per batch fetched): the probe fits the run to the budget before step 1, the
    schedule warms up and reaches zero at the fitted end, and a resumed run keeps the fitted schedule."""
    import hstap.train.run as run_module

    clock = {"t": 0.0}
    real_load = run_module.load_batch

    def load_tick(*args, **kw):
        clock["t"] += 1.0
        return real_load(*args, **kw)

    monkeypatch.setattr(run_module, "load_batch", load_tick)
    monkeypatch.setattr(run_module.time, "perf_counter", lambda: clock["t"])
    budget = 30  # the probe's batches (at most 13), then one-second steps
    cfg = TrainConfig(store=small_store, out=tmp_path / "run", epochs=50, batch_tokens=256, time_budget_s=budget,
                      checkpoint_every=1000, **FAST)
    result = run_train(cfg, progress=False)
    records = load_metrics(tmp_path / "run" / "metrics.jsonl")
    fitted = [r for r in records if r["kind"] == "budget"]
    assert len(fitted) == 1 and fitted[0]["seconds_per_step"] == 1.0
    steps = budget - fitted[0]["probe_steps"]  # every fetch ticks one second: what the probe left of the budget
    assert fitted[0]["total_steps"] == steps and 17 <= steps <= 29 and result.steps == steps
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(cfg.lr)  # warmed up and decayed fully

    more = cfg.model_copy(update={"resume": True})  # the checkpoint holds the fitted total: nothing left to do
    assert run_train(more, progress=False).steps == steps


def test_init_from_continues_an_earlier_drafter(small_store, tmp_path):
    """`--init-from` starts where an earlier run (another device session, a smaller set) ended: its weights and
    its draft vocabulary, loaded from the bf16 copy without the embedding that travels between machines."""
    first = run_train(TrainConfig(store=small_store, out=tmp_path / "a", max_steps=3, batch_tokens=768, **FAST),
                      progress=False)
    shipped = first.drafter.to(torch.bfloat16)
    shipped.save_pretrained(tmp_path / "shipped", include_embedding=False)
    # a draft-vocab size the first run did not use: the initialised drafter keeps its own vocabulary
    # one step at a vanishing learning rate: what it started from, the shipped weights
    again = run_train(TrainConfig(store=small_store, out=tmp_path / "b", max_steps=1, batch_tokens=768, lr=1e-12,
                                  init_from=tmp_path / "shipped", **{**FAST, "draft_vocab": 1024}), progress=False)
    assert torch.equal(again.drafter.d2t, first.drafter.d2t)
    for name, value in shipped.trainable_state_dict().items():
        expected = value.float() if value.is_floating_point() else value  # d2t, t2d: exact
        torch.testing.assert_close(again.drafter.trainable_state_dict()[name].cpu(), expected, rtol=0, atol=1e-9)

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "shipped", other)
    cfg_json = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg_json, "aux_layer_ids": [2, 14, 26]}))
    with pytest.raises(HstapError, match=r"--init-from: drafter in .* has aux_layer_ids=\[2, 14, 26\]"):
        run_train(TrainConfig(store=small_store, out=tmp_path / "c", init_from=other, **FAST), progress=False)
