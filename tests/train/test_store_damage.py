"""`hstap train --store` on a damaged store: a flipped byte or a truncated shard stops it in one line naming the
shard (never a SafetensorError traceback, never silent training on wrong numbers); `--skip-bad-shards` trains on
the rest and says what it left out."""

from __future__ import annotations

import pytest

from hstap.errors import HstapError
from hstap.store import StoreWriter, open_store
from hstap.train.config import TrainConfig
from hstap.train.run import run_train

FAST = dict(draft_vocab=2048, ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0, max_steps=1, batch_tokens=512)


@pytest.fixture(scope="module")
def sharded(small_store, tmp_path_factory):
    """The session's small capture rewritten in four shards (real states; a shard can be damaged alone)."""
    src = open_store(small_store)
    out = tmp_path_factory.mktemp("sharded") / "store"
    per_shard = src.manifest.totals.bytes // 4
    with StoreWriter(out, src.manifest.meta, shard_bytes=per_shard) as w:
        for sample in src:
            flat = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"],
                    **{f"hidden.{k}": t for k, t in sample["hidden"].items()},
                    **{f"teacher.{k}": t for k, t in sample["teacher"].items()}}
            w.add(sample["id"], flat)
    assert len(open_store(out).manifest.shards) >= 3
    return out


@pytest.fixture
def loaded_once(target, monkeypatch):
    monkeypatch.setattr("hstap.models.load_target", lambda *a, **k: target)


def _damaged(sharded, tmp_path, damage):
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(sharded, copy)
    shard = copy / open_store(copy).manifest.shards[1].file
    data = bytearray(shard.read_bytes())
    shard.write_bytes(damage(data))
    return copy, shard.name


def _flip(data: bytearray) -> bytes:
    data[-5] ^= 0x10  # a hidden-state byte: a silently wrong number if nothing checked
    return bytes(data)


@pytest.mark.parametrize("damage, needle", [(_flip, "sha256 mismatch"), (lambda d: bytes(d[:-64]), "truncated")])
def test_damaged_shard_stops_training_naming_it(sharded, tmp_path, loaded_once, damage, needle):
    store, name = _damaged(sharded, tmp_path, damage)
    with pytest.raises(HstapError, match=rf"{name}: .*{needle}.*--skip-bad-shards") as e:
        run_train(TrainConfig(store=store, out=tmp_path / "run", **FAST), progress=False)
    assert "\n" not in str(e.value)


def test_skip_bad_shards_trains_on_the_rest_and_reports_it(sharded, tmp_path, loaded_once, capsys):
    store, name = _damaged(sharded, tmp_path, _flip)
    lost = len(open_store(sharded).manifest.shards[1].samples)
    result = run_train(TrainConfig(store=store, out=tmp_path / "run", skip_bad_shards=True, **FAST), progress=False)
    assert result.steps == 1
    out = capsys.readouterr().out
    assert f"hstap train: skipped 1 damaged shards of {len(open_store(sharded).manifest.shards)} ({lost} samples" in out
    assert f"{name}: sha256 mismatch" in out
