"""Training learns: on real SmolLM2 states of real ShareGPT conversations the held-out loss falls and the drafter's
first-step accuracy rises; the run directory holds what a user needs; the saved drafter reloads."""

from __future__ import annotations

import json

import pytest
import torch

from hstap.drafter import Eagle3Drafter
from hstap.train.config import TrainConfig
from hstap.train.run import load_metrics, run_train
from tests.train.test_run import FAST


def _weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


@pytest.fixture(scope="module")
def trained(small_store, tmp_path_factory):
    """The session's small store (48 short ShareGPT conversations captured from SmolLM2, ~4k tokens), 4 epochs of
    small batches at a high learning rate: enough to learn, and it reuses a capture other tests make anyway (on a
    CPU the capture that feeds training costs about as much as the training). Two TTT steps: a third cost a
    third more time (30 s of the suite's 2 cores) and showed no more learning than two."""
    out = tmp_path_factory.mktemp("drafter") / "run"
    cfg = TrainConfig(store=small_store, out=out, epochs=4, lr=5e-3, batch_tokens=1024, **{**FAST, "ttt_steps": 2})
    return run_train(cfg, progress=False)


def test_training_lowers_heldout_loss_and_lifts_step0_accuracy(trained):
    before, after = trained.initial_heldout, trained.heldout
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, step-0 acc {before['acc'][0]:.3f} -> "
          f"{after['acc'][0]:.3f}, tau_est {after['tau_est']}")
    assert after["loss"] < before["loss"] * 0.75  # measured 13.94 -> 9.84 (2026-12-04; TTT 3: 18.86 -> 13.47)
    assert before["acc"][0] < 0.02  # untrained: chance level over a 2048-token draft vocabulary
    assert after["acc"][0] > 0.15  # measured 0.207
    assert after["tau_est"][1] > 1.12  # measured 1.16


def test_run_directory_contents(trained):
    out = trained.out
    for name in ["config.json", "model.safetensors", "train_config.json", "metrics.jsonl", "loss.png",
                 "accuracy.png", "tau_estimate.png", "checkpoint/trainer.pt"]:
        assert (out / name).exists(), name
    records = load_metrics(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["epoch"] for r in evals] == [0, 1, 2, 3, 4]
    assert set(evals[-1]["tau_est"]) == {"1", "2"} and len(evals[-1]["acc"]) == 2  # one per TTT step
    assert sum(r["kind"] == "train" for r in records) == trained.steps
    config = json.loads((out / "config.json").read_text())
    assert config["aux_layer_ids"] == [1, 14, 26] and config["draft_vocab_size"] == 2048


def test_saved_drafter_reloads_with_the_target_embedding(trained, target):
    again = Eagle3Drafter.from_pretrained(trained.out)
    for name, value in _weights(trained.drafter).items():
        assert torch.equal(again.state_dict()[name], value), name
    assert torch.equal(again.embed_tokens.weight, target.model.get_input_embeddings().weight)
