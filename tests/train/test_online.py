"""The device-resident online source against the capture path, on real SmolLM2 and real ShareGPT conversations:
the same batches up to rounding, the same training losses, and a run that logs TensorBoard scalars and a measured τ
next to the estimated one."""

from __future__ import annotations

import math

import pytest
import torch

import hstap.train.build as build_module
from hstap.config import rounding_step
from hstap.data import SkipReport, render_all
from hstap.train.config import TrainConfig
from hstap.train.data import OnlineSource
from hstap.train.online import DeviceOnlineSource
from hstap.train.run import load_metrics, run_train
from hstap.train.tblog import scalars
from hstap.train.ttt import TTTBatch, collate

LAYERS = [1, 14, 26]
FIELDS = list(TTTBatch.__dataclass_fields__)


@pytest.fixture(scope="module")
def samples(tokenizer):
    """The ShareGPT conversations among the first 60 that are shorter than 200 tokens: lengths 42 to 191, so
    every batch below is padded."""
    short = [s for s in render_all("sharegpt", tokenizer, SkipReport(), max_tokens=200, limit=60)
             if len(s.input_ids) < 200]
    assert len(short) >= 6 and len({len(s.input_ids) for s in short}) == len(short)
    return short[:6]


def assert_same_batch(old: TTTBatch, new: TTTBatch, dtype: str) -> None:
    """Every field equal; floats within one rounding step of their storage dtype (aux: `dtype`; teacher: fp16)."""
    for name in ("input_ids", "loss_mask", "valid"):
        assert torch.equal(getattr(old, name), getattr(new, name)), name
    assert old.aux.dtype == new.aux.dtype
    torch.testing.assert_close(new.aux, old.aux, rtol=rounding_step(dtype), atol=1e-6)
    torch.testing.assert_close(new.topk_logprobs, old.topk_logprobs, rtol=rounding_step("fp16"), atol=1e-6)
    # two candidates whose log-probs round to the same fp16 value may swap ranks between two lm_head shapes
    swapped = old.topk_ids != new.topk_ids
    assert swapped.float().mean() < 0.01, f"{int(swapped.sum())} top-k ids differ"
    close = (old.topk_logprobs - new.topk_logprobs).abs() <= old.topk_logprobs.abs() * rounding_step("fp16")
    assert bool(close[swapped].all()), "a differing top-k id is not a near tie"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_device_batch_equals_the_capture_path(target, samples, dtype):
    """Small lm_head chunks (50 positions) so the chunked teacher is exercised; one batch built directly, one
    through `prefetch`, in an order unlike the source's."""
    old = OnlineSource(target, samples, LAYERS, dtype=dtype)
    vocab = target.model.config.vocab_size
    new = DeviceOnlineSource(target, samples, LAYERS, dtype=dtype, chunk_bytes=4 * vocab * 50)
    assert new.chunk == 50 and new.ids == old.ids and new.lengths == old.lengths
    first, second = [4, 0, 5], [3, 1]  # lengths 75, 122, 42 and 172, 105
    assert_same_batch(collate(old.fetch(first), LAYERS), new.batch(first), dtype)
    if dtype == "bf16":
        new.prefetch(second)
        assert_same_batch(collate(old.fetch(second), LAYERS), new.batch(second), dtype)
        assert not new._pending, "a prefetched batch is handed out once"


def test_fp8_online_states_are_what_an_fp8_store_hands_the_trainer(target, samples):
    """`--online-dtype fp8` against the capture path with `--dtype fp8` read back as the trainer reads a store
    (`load_batch`: fp8 + scales, dequantised): exactly the store's quantiser and reader applied to the bf16 states,
    and close to the capture path's fp8, which on this CPU rounded the fp32 states instead of their bf16 copy
    (on a GPU both see the same bf16 states)."""
    from hstap.store.fp8 import dequantize, quantize
    from hstap.train.data import load_batch

    rows = [4, 0, 5]
    stored = load_batch(OnlineSource(target, samples, LAYERS, dtype="fp8"), rows, LAYERS, torch.device("cpu"))
    online = DeviceOnlineSource(target, samples, LAYERS, as_fp8=True).batch(rows)
    plain = DeviceOnlineSource(target, samples, LAYERS).batch(rows)
    assert online.aux.dtype == stored.aux.dtype == torch.bfloat16
    def off(a: torch.Tensor, b: torch.Tensor) -> float:  # relative norm of the difference, as `hstap compare`
        return float((a.float() - b.float()).norm() / b.float().norm())

    expected = plain.aux.clone()  # the definition: each layer through the store's own quantiser and reader
    for j in range(len(LAYERS)):
        part = expected[..., j * target.hidden_size:(j + 1) * target.hidden_size]
        part.copy_(dequantize(*quantize(part)))
    assert torch.equal(online.aux, expected)
    # the capture path's fp8 (this CPU rounds fp32 states, not their bf16 copy: some rows get another scale)
    assert off(online.aux, stored.aux) < 0.003
    assert 0.002 < off(online.aux, plain.aux) < 0.03  # rounded: an fp8 store is ≤ 0.023 from bf16 (docs)
    assert torch.equal(online.aux[~online.valid], torch.zeros_like(online.aux[~online.valid]))  # padding stays 0


def test_online_dtype_is_refused_for_a_store(tmp_path):
    from hstap.errors import HstapError
    from hstap.train.rundir import preflight

    with pytest.raises(HstapError, match=r"--online-dtype fp8 is for --online"):
        preflight(TrainConfig(store=tmp_path / "store", out=tmp_path / "run", online_dtype="fp8"))


# batches of 256 tokens (were 512): the two runs are compared with each other, not with a size, and every online
# batch is a forward of the target (-9 s of a core)
COMMON = dict(online=True, data="sharegpt", limit=16, max_tokens=64, max_steps=3, epochs=5, batch_tokens=256,
              draft_vocab=1024, ttt_steps=2, heldout=0.25, seed=0)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same online run through the capture path (OnlineSource, no calibration) and through the device source
    (prefetching, calibrating on 2 held-out prompts × 8 tokens)."""
    real_open = build_module.open_source

    def capture_path(cfg, target, device):
        source, layer_ids, teacher = real_open(cfg, target, device)
        return OnlineSource(target, source.samples, layer_ids, teacher=teacher, device=str(device)), layer_ids, teacher

    out = tmp_path_factory.mktemp("online")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "open_source", capture_path)
        old = run_train(TrainConfig(out=out / "old", calib_prompts=0, **COMMON), progress=False)
    new = run_train(TrainConfig(out=out / "new", prefetch=True, calib_prompts=2, calib_tokens=8, **COMMON),
                    progress=False)
    return old, new


def test_device_path_trains_exactly_like_the_capture_path(two_runs):
    old, new = two_runs
    losses = [[r["loss"] for r in load_metrics(run.out / "metrics.jsonl") if r["kind"] == "train"]
              for run in (old, new)]
    assert len(losses[0]) == 3
    torch.testing.assert_close(torch.tensor(losses[1], dtype=torch.float64),
                               torch.tensor(losses[0], dtype=torch.float64), rtol=1e-5, atol=0)
    for name, value in old.drafter.trainable_state_dict().items():
        torch.testing.assert_close(new.drafter.trainable_state_dict()[name], value, rtol=1e-4, atol=1e-6)


def test_calibration_logs_measured_and_estimated_tau(two_runs):
    old, new = two_runs
    evals = [r for r in load_metrics(new.out / "metrics.jsonl") if r["kind"] == "eval"]
    assert "calibration" not in evals[0], "the untrained drafter is not calibrated"
    calib = evals[-1]["calibration"]
    assert calib["chain"] == 2 and calib["prompts"] == 2 and 0 < calib["tokens"] <= 16
    assert all(math.isfinite(calib[key]) for key in ("tau_measured", "tau_est", "gap", "seconds", "tau_est_same",
                                                      "gap_same"))
    assert calib["gap_same"] == pytest.approx(calib["tau_measured"] - calib["tau_est_same"])
    assert 1.0 <= calib["tau_measured"] <= calib["chain"] + 1
    assert calib["tau_est"] == pytest.approx(evals[-1]["tau_est"]["2"])
    assert calib["gap"] == pytest.approx(calib["tau_measured"] - calib["tau_est"])
    assert "measured τ (chain 2, 2 held-out prompts" in new.summary()
    assert "measured τ" not in old.summary()


def test_tensorboard_events_hold_the_metrics(two_runs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, new = two_runs
    events = list((new.out / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(new.out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/step_losses/1", "eval/loss", "eval/acc/0", "eval/tau_est/2",
            "eval/calibration/tau_measured", "eval/calibration/gap"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    train = [r for r in load_metrics(new.out / "metrics.jsonl") if r["kind"] == "train"]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in train], rel=1e-6)


def test_scalars_flatten_a_record_by_kind_and_path():
    record = {"kind": "eval", "epoch": 1, "step": 7, "loss": 2.5, "acc": [0.5, 0.25], "tau_est": {"1": 1.5},
              "calibration": {"chain": 3, "tau_measured": float("nan")}, "note": "text", "flag": True}
    got = scalars(record)
    assert set(got) == {"eval/loss", "eval/acc/0", "eval/acc/1", "eval/tau_est/1", "eval/calibration/chain",
                        "eval/calibration/tau_measured"}
    assert got["eval/acc/1"] == 0.25 and math.isnan(got["eval/calibration/tau_measured"])


def test_calibration_prompts_are_the_rendered_first_turns(tokenizer, samples):
    """Cut before the first answer token, a rendered sample is the prompt `hstap eval` would decode from."""
    from hstap.evaluate.run import load_prompts
    from hstap.train.calibrate import calibration_prompts

    class Source:  # what calibration_prompts reads of a training source
        ids = [s.id for s in samples]

        def token_masks(self, i):
            return torch.tensor(samples[i].input_ids), torch.tensor(samples[i].loss_mask)

    got = calibration_prompts(Source(), [3, 1, 4, 0], n=3)
    assert [p.id for p in got] == [samples[i].id for i in (3, 1, 4)]
    rendered = {p.id: p.ids for p in load_prompts("sharegpt", tokenizer, limit=80)}
    for prompt in got:
        assert prompt.ids == rendered[prompt.id]


def test_the_calibrations_serving_copy_carries_no_gradients_and_leaves_the_trainers():
    """A trainer that keeps its gradients between steps (--cuda-graphs, --grad-reduce after: the graphs and the
    flat buffer write into them) hands the calibration a drafter whose serving copy must not carry them (1.7 GB at
    8B); the trainer's own gradients stay the very tensors the graphs write into."""
    from hstap.train.calibrate import _without_gradients

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    copy = _without_gradients(model)
    assert all(p.grad is None for p in copy.parameters())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.parameters()))
