"""A training step's numbers are logged one step late, so the host never waits on the device for them: the step
itself reads nothing back, and every step's line is still written, in order, with its own numbers."""

from __future__ import annotations

import torch

from hstap.train.steplog import StepLog


def test_a_step_is_written_when_the_next_is_held_or_on_flush():
    written: list[dict] = []
    log = StepLog(written.append)
    log.hold({"kind": "train", "step": 1, "loss": None, "step_losses": None, "lr": 0.1, "grad_norm": None},
             torch.tensor(2.5), torch.tensor(0.75), torch.tensor([2.0, 3.0]))
    assert written == []  # held: the device may still be computing these
    log.hold({"kind": "train", "step": 2, "loss": None, "step_losses": None, "lr": 0.2, "grad_norm": None},
             torch.tensor(1.5), torch.tensor(0.5), torch.tensor([1.0, 2.0]))
    assert written == [{"kind": "train", "step": 1, "loss": 2.5, "step_losses": [2.0, 3.0], "lr": 0.1,
                        "grad_norm": 0.75}]
    assert list(written[0]) == ["kind", "step", "loss", "step_losses", "lr", "grad_norm"]  # the record's order
    log.flush()
    log.flush()  # nothing held: nothing written twice
    assert [r["step"] for r in written] == [1, 2] and written[1]["loss"] == 1.5


def test_a_training_step_reads_nothing_back(small_store, target, monkeypatch):
    """`accumulate` and the clipping return device tensors: a read-back (`tolist`, `item`, `float`) anywhere in
    the step would make the host wait for the device there."""
    from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
    from hstap.store import open_store
    from hstap.train import distributed
    from hstap.train.data import StoreSource, load_batch
    from hstap.train.trainer import accumulate
    from hstap.train.ttt import TTTModel, autocast

    store = open_store(small_store)
    layers = list(store.manifest.meta.layer_ids)
    source, device = StoreSource(store), torch.device("cpu")
    vocab = target.model.config.vocab_size
    batch = load_batch(source, [0, 1, 2, 3], layers, device)
    d2t, _ = build_draft_vocab(torch.bincount(batch.input_ids[batch.valid], minlength=vocab), 2048)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target.model.config, layers, 2048, "m", "f"))
    model = TTTModel(drafter, target_to_draft_ids(d2t, vocab), 2, 0.8)

    def refuse(*args, **kwargs):
        raise AssertionError("a read-back inside the training step")

    for name in ("tolist", "item", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss, step_losses = accumulate(model, source, [[0, 1], [2, 3]], layers, device, autocast(device),
                                   distributed.setup("cpu"), [[2, 3], None])
    norm = torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], 1.0)
    monkeypatch.undo()
    assert loss.dim() == 0 and step_losses.shape == (2,) and norm.dim() == 0 and bool(torch.isfinite(loss))
