"""The trainer's store input: the next batch is read and collated on a host thread while the device trains on the
one before (`StoreSource.prefetch`), into the same tensors a read made on the spot gives; its errors reach the
trainer when the batch is asked for; a `hidden` teacher becomes top-k per batch where the lm_head lives."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from hstap.capture.teacher import topk_logprobs
from hstap.errors import HstapError
from hstap.store import open_store
from hstap.store.reader import Store
from hstap.train.data import HIDDEN_TEACHER_K, StoreSource, load_batch
from hstap.train.build import teacher_head
from hstap.train.ttt import TTTBatch

CPU = torch.device("cpu")


@pytest.fixture
def read_threads(monkeypatch) -> list[str]:
    """The name of the thread each whole-sample store read ran on."""
    names: list[str] = []
    read = Store.read

    def recording(self, i, keys=None, dequantize=True):
        if keys is None:
            names.append(threading.current_thread().name)
        return read(self, i, keys, dequantize)

    monkeypatch.setattr(Store, "read", recording)
    return names


def _assert_collated(batch: TTTBatch, store, indices: list[int], layers: list[int]) -> None:
    """Row r of `batch` is sample indices[r] as the store holds it, right-padded with zeros, False and -inf."""
    for row, i in enumerate(indices):
        sample = store[i]
        n = sample["input_ids"].numel()
        want = torch.cat([sample["hidden"][k] for k in layers], dim=-1)
        assert torch.equal(batch.aux[row, :n], want) and not batch.aux[row, n:].any()
        assert torch.equal(batch.input_ids[row, :n], sample["input_ids"]) and not batch.input_ids[row, n:].any()
        assert torch.equal(batch.loss_mask[row, :n], sample["loss_mask"]) and not batch.loss_mask[row, n:].any()
        assert batch.valid[row, :n].all() and not batch.valid[row, n:].any()
        assert torch.equal(batch.topk_ids[row, :n], sample["teacher"]["topk_ids"].long())
        assert torch.equal(batch.topk_logprobs[row, :n], sample["teacher"]["topk_logprobs"].float())
        assert not batch.topk_ids[row, n:].any() and (batch.topk_logprobs[row, n:] == -float("inf")).all()


def test_a_prefetched_batch_is_read_on_the_worker_and_equals_one_read_now(small_store, read_threads):
    store = open_store(small_store)
    layers = list(store.manifest.meta.layer_ids)
    source = StoreSource(store)
    rows = [35, 0, 34]  # 42, 96 and 75 tokens: two rows padded
    assert len({source.lengths[i] for i in rows}) == 3
    source.prefetch(rows)
    ahead = load_batch(source, rows, layers, CPU)
    assert read_threads and all(name.startswith("hstap-store-batch") for name in read_threads)
    read_threads.clear()
    now = load_batch(source, rows, layers, CPU)
    assert read_threads == ["MainThread"] * 3
    for name in TTTBatch.__dataclass_fields__:
        assert torch.equal(getattr(ahead, name), getattr(now, name)), name
    _assert_collated(ahead, store, rows, layers)

    # one batch ahead at most: a prefetch nobody asked for is dropped when the next is asked ahead, and a batch
    # asked for without a prefetch is read then
    source.prefetch([1, 2])
    source.prefetch([3, 4])
    _assert_collated(load_batch(source, [1, 2], layers, CPU), store, [1, 2], layers)
    _assert_collated(load_batch(source, [3, 4], layers, CPU), store, [3, 4], layers)


def test_a_damaged_shard_read_ahead_is_said_when_its_batch_is_asked_for(small_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(small_store, copy)
    store = open_store(copy)
    shard = copy / store.manifest.shards[0].file
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    source = StoreSource(store)
    source.prefetch([0, 1])  # the worker meets the damage; nothing is raised on this thread yet
    with pytest.raises(HstapError, match=rf"{shard.name}: sha256 mismatch") as e:
        load_batch(source, [0, 1], list(store.manifest.meta.layer_ids), CPU)
    assert "\n" not in str(e.value)


def _capture(target, out, teacher: str):
    """Eight real ShareGPT conversations in fp32 (so the two teachers' logits are the same arithmetic)."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.run import run_capture

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hstap.capture.run.load_target", lambda *a, **k: target)
        run_capture(CaptureConfig(data="sharegpt", limit=8, max_tokens=96, dtype="fp32", teacher=teacher, out=out),
                    progress=False)
    return out


@pytest.fixture(scope="module")
def hidden_store(target, tmp_path_factory):
    """Captured with the final normed state as teacher: what the SGLang and vLLM taps store."""
    return _capture(target, tmp_path_factory.mktemp("hidden_teacher") / "store", "hidden")


def test_a_hidden_teacher_becomes_the_top_k_of_each_row_where_the_head_lives(hidden_store, target, read_threads):
    store = open_store(hidden_store)
    layers = list(store.manifest.meta.layer_ids)
    head = target.model.get_output_embeddings()
    source = StoreSource(store, lm_head=head)
    rows = [2, 0, 4]
    source.prefetch(rows)
    batch = load_batch(source, rows, layers, CPU)
    assert read_threads and all(name.startswith("hstap-store-batch") for name in read_threads)
    assert batch.topk_ids.shape == (3, batch.aux.shape[1], HIDDEN_TEACHER_K)
    for row, i in enumerate(rows):
        sample = store[i]
        n = sample["input_ids"].numel()
        with torch.no_grad():
            values, ids = topk_logprobs(head(sample["teacher"]["hidden"].to(head.weight.dtype)), HIDDEN_TEACHER_K)
        # the logits of a row do not depend on the rows beside it (fp32 on this CPU): the same ids, and the
        # log-probs rounded through fp16 as a top-k store holds them
        assert torch.equal(batch.topk_ids[row, :n], ids)
        torch.testing.assert_close(batch.topk_logprobs[row, :n], values.half().float(), rtol=2 ** -10, atol=0)
        assert not batch.topk_ids[row, n:].any() and (batch.topk_logprobs[row, n:] == -float("inf")).all()
    with pytest.raises(HstapError, match="hidden` teacher: the target's lm_head is needed"):
        load_batch(StoreSource(store), rows, layers, CPU)


def test_training_on_a_hidden_teacher_store_equals_training_on_a_top_k_one(hidden_store, target, tmp_path,
                                                                         monkeypatch):
    """The engine taps' store (final hidden state) and the embedded capture's (top-32 log-probs) of the same
    conversations train the same drafter: the trainer's per-batch top-k is the capture's, up to the fp16 rounding
    both stores' log-probs take."""
    from hstap.train.config import TrainConfig
    from hstap.train.run import load_metrics, run_train

    topk_store = _capture(target, tmp_path / "topk-store", "topk:32")
    monkeypatch.setattr("hstap.models.load_target", lambda *a, **k: target)
    losses = {}
    for name, store in (("hidden", hidden_store), ("topk", topk_store)):
        run_train(TrainConfig(store=store, out=tmp_path / f"run-{name}", max_steps=3, batch_tokens=256, draft_vocab=2048,
                              ttt_steps=2, heldout=0.0, seed=0, calib_prompts=0), progress=False)
        losses[name] = [r["loss"] for r in load_metrics(tmp_path / f"run-{name}" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses["topk"]) == 3
    torch.testing.assert_close(torch.tensor(losses["hidden"]), torch.tensor(losses["topk"]), rtol=1e-4, atol=0)


def test_the_head_of_a_hidden_teacher_is_put_on_the_training_device(target):
    """Off the device the teacher's logits would be a CPU's work per batch (minutes a sample at 8B)."""
    head = target.model.get_output_embeddings()
    assert teacher_head(head, CPU) is head
    moved = teacher_head(head, torch.device("meta"))  # a device this CPU has, standing in for the GPU
    assert moved.weight.device.type == "meta" and not moved.weight.requires_grad
    assert head.weight.device == CPU  # the target keeps its own


@pytest.mark.parametrize("prefetch", [False, True])
def test_training_on_a_store_reads_its_next_batch_ahead_when_a_gpu_trains_or_when_asked(small_store, tmp_path,
                                                                                          read_threads, prefetch):
    """Read ahead where the device is not the host (CUDA: always) or with --prefetch; on this CPU, by default, the
    read would only compete with the step's own threads (bench/store_input.py's note in docs/benchmarks.md)."""
    from hstap.train.config import TrainConfig
    from hstap.train.run import run_train

    run_train(TrainConfig(store=small_store, out=tmp_path / "run", max_steps=3, batch_tokens=512, draft_vocab=2048,
                          ttt_steps=2, heldout=0.1, seed=0, calib_prompts=0, prefetch=prefetch), progress=False)
    assert any(name.startswith("hstap-store-batch") for name in read_threads) == prefetch, set(read_threads)


@pytest.mark.gpu
def test_pinned_batches_copied_beside_the_step_equal_the_cpu_ones(small_store):
    """On CUDA the batch is collated into pinned memory and copied on a side stream while the current stream still
    computes (a stand-in step of matmuls here): every batch arrives whole, the same as the CPU's."""
    store = open_store(small_store)
    layers = list(store.manifest.meta.layer_ids)
    cuda = torch.device("cuda")
    pinned, plain = StoreSource(store, pin=True), StoreSource(store)
    plan = [[35, 0, 34], [1, 2], [3, 4, 5], [6]]
    pinned.prefetch(plan[0])
    busy = torch.randn(2048, 2048, device=cuda)
    for n, rows in enumerate(plan):
        got = load_batch(pinned, rows, layers, cuda)
        if n + 1 < len(plan):
            pinned.prefetch(plan[n + 1])
        for _ in range(20):  # the step the next batch's read and copy overlap
            busy = torch.tanh(busy @ busy)
        want = load_batch(plain, rows, layers, CPU)
        for name in TTTBatch.__dataclass_fields__:
            assert getattr(got, name).is_cuda and torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
