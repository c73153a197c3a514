"""Synthetic samples for store tests: the store is model-agnostic, so random tensors of the conventional shapes do."""

from __future__ import annotations

import pytest
import torch

from hstap.store import StoreMeta, StoreWriter

LAYERS = [1, 14, 26]
H = 16
K = 4


@pytest.fixture
def meta() -> StoreMeta:
    return StoreMeta(
        model_id="test/tiny",
        model_fingerprint="abc123",
        layer_ids=LAYERS,
        hidden_size=H,
        hidden_dtype="bf16",
        teacher=f"topk:{K}",
        extra={"max_len": 64},
    )


def make_sample(seed: int, length: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = length if length is not None else int(torch.randint(3, 40, (1,), generator=g))
    sample = {
        "input_ids": torch.randint(0, 49152, (s,), generator=g),  # int64, as a tokenizer returns
        "loss_mask": torch.rand(s, generator=g) > 0.5,
        "teacher.topk_ids": torch.randint(0, 49152, (s, K), generator=g, dtype=torch.int32),
        "teacher.topk_logprobs": torch.randn(s, K, generator=g),
    }
    for k in LAYERS:
        sample[f"hidden.{k}"] = torch.randn(s, H, generator=g).to(torch.bfloat16)
    return sample


def write_samples(path, meta: StoreMeta, ids: range, shard_bytes: int = 4096) -> list[str]:
    """Write samples `s{i}` (seeded by i) into a store at `path`; returns the files the writer cleaned on open."""
    with StoreWriter(path, meta, shard_bytes=shard_bytes) as w:
        for i in ids:
            w.add(f"s{i}", make_sample(i))
    return w.cleaned


def assert_sample_equal(got: dict, want: dict[str, torch.Tensor]) -> None:
    assert got["input_ids"].dtype == torch.int64
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert got["loss_mask"].dtype == torch.bool
    assert torch.equal(got["loss_mask"], want["loss_mask"])
    assert sorted(got["hidden"]) == LAYERS
    for k in LAYERS:
        assert got["hidden"][k].dtype == torch.bfloat16
        # bitwise: compare the raw bits, not values (equal NaN payloads, -0.0 vs 0.0 would slip through ==)
        assert torch.equal(got["hidden"][k].view(torch.int16), want[f"hidden.{k}"].view(torch.int16))
    assert torch.equal(got["teacher"]["topk_ids"], want["teacher.topk_ids"])
    logprobs = got["teacher"]["topk_logprobs"]
    assert torch.equal(logprobs.view(torch.int32), want["teacher.topk_logprobs"].view(torch.int32))
