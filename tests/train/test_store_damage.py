"""`hstap train --store` on a damaged store: a flipped byte or a truncated shard stops it in one line naming the
shard (never a SafetensorError traceback, never silent training on wrong numbers); `--skip-bad-shards` trains on
the rest and says what it left out."""

from __future__ import annotations

import json

import pytest

from hstap.capture.config import CaptureConfig
from hstap.capture.run import run_capture
from hstap.errors import HstapError
from hstap.store import open_store
from hstap.train.config import TrainConfig
from hstap.train.run import run_train

FAST = dict(draft_vocab=2048, ttt_steps=3, heldout=0.25, seed=0, calib_prompts=0, max_steps=1, batch_tokens=1024)
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Opposite of hot?", "Two plus two?",
             "How many legs does a spider have?", "What colour is the sky?", "Say hello.", "Name a fruit."]


@pytest.fixture(scope="module")
def sharded(target, tmp_path_factory):
    """A real capture of eight short conversations, one shard each (a shard can be damaged alone)."""
    d = tmp_path_factory.mktemp("sharded")
    (d / "convs.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "A short answer."}]}) + "\n"
        for i, q in enumerate(QUESTIONS)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hstap.capture.run.load_target", lambda *a, **k: target)
        run_capture(CaptureConfig(data=f"jsonl:{d / 'convs.jsonl'}", out=d / "store", shard_mb=0.1), progress=False)
    assert len(open_store(d / "store").manifest.shards) >= 4
    return d / "store"


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
