"""`hstap store merge`: several nodes' stores as one, shards linked or copied (checked), the manifest last; a merge
killed part-way is finished by the same command; every refusal in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hstap.errors import HstapError
from hstap.store import StoreWriter, open_store, verify_store
from hstap.store.manifest import MANIFEST_NAME, load_manifest
from hstap.store.merge import PLAN_NAME, merge_stores

from .conftest import assert_sample_equal, make_sample, write_samples


@pytest.fixture
def nodes(tmp_path, meta):
    """Two nodes' stores of different samples (several shards each), as a multi-node capture leaves them."""
    write_samples(tmp_path / "node0", meta, range(0, 12))
    write_samples(tmp_path / "node1", meta.model_copy(update={"extra": {"max_len": 64, "node": 1}}), range(12, 20))
    return tmp_path / "node0", tmp_path / "node1"


def _shards(path) -> int:
    return len(load_manifest(path / MANIFEST_NAME).shards)


def test_merged_store_holds_every_sample_of_each_node_bitwise_and_verifies(nodes, tmp_path):
    report = merge_stores(tmp_path / "all", list(nodes), progress=False)
    assert report.samples == 20 and report.shards == _shards(nodes[0]) + _shards(nodes[1]) > 2
    assert report.linked == report.shards and report.copied == report.kept == 0
    store = open_store(tmp_path / "all")
    assert store.ids() == [f"s{i}" for i in range(20)]
    for i in range(20):
        assert_sample_equal(store[i], make_sample(i))
    assert verify_store(tmp_path / "all") == []
    first = load_manifest(nodes[0] / MANIFEST_NAME).shards[0].file
    assert os.path.samefile(tmp_path / "all" / "shard-00000.safetensors", nodes[0] / first)  # linked, not copied
    extra = store.manifest.meta.extra
    assert extra["max_len"] == 64 and "node" not in extra  # kept where the nodes agree ...
    assert [(m["samples"], m.get("node")) for m in extra["merged_from"]] == [(12, None), (8, 1)]  # ... each its own
    assert not (tmp_path / "all" / PLAN_NAME).exists()


def test_copy_checks_each_shard_and_names_a_damaged_one(nodes, tmp_path, capsys):
    from hstap.cli import main

    assert main(["store", "merge", str(nodes[0]), str(nodes[1]), "--out", str(tmp_path / "copied"), "--copy"]) == 0
    total = _shards(nodes[0]) + _shards(nodes[1])
    assert capsys.readouterr().out.strip().endswith(
        f"20 samples, {load_manifest(tmp_path / 'copied' / MANIFEST_NAME).totals.tokens:,} tokens, {total} shards "
        f"(0 hard-linked, {total} copied, 0 already in place)")
    assert not os.path.samefile(tmp_path / "copied" / "shard-00000.safetensors",
                                nodes[0] / load_manifest(nodes[0] / MANIFEST_NAME).shards[0].file)
    assert verify_store(tmp_path / "copied") == []

    shard = nodes[1] / load_manifest(nodes[1] / MANIFEST_NAME).shards[1].file
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte, same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(HstapError, match=f"{shard.name}: sha256 mismatch") as err:
        merge_stores(tmp_path / "damaged", list(nodes), copy=True, progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "damaged" / MANIFEST_NAME).exists()  # not a store
    assert not list((tmp_path / "damaged").glob("*.tmp"))


def test_a_merge_killed_part_way_is_finished_by_the_same_command(nodes, tmp_path):
    out = tmp_path / "all"
    cmd = [sys.executable, "-m", "hstap.cli", "store", "merge", str(nodes[0]), str(nodes[1]), "--out", str(out),
           "--copy"]
    killed = subprocess.run(cmd, env={**os.environ, "HSTAP_FAULT": "merge-shard:3"}, capture_output=True, text=True)
    assert killed.returncode == -9
    placed = sorted(out.glob("shard-*.safetensors"))
    assert not (out / MANIFEST_NAME).exists() and len(placed) == 3
    inodes = [f.stat().st_ino for f in placed]  # a shard copied again would be a new file
    done = subprocess.run(cmd, env={**os.environ, "HSTAP_FAULT": "merge-manifest"}, capture_output=True, text=True)
    assert done.returncode == -9  # killed again, this time with the manifest written: OUT is a whole store
    total = _shards(nodes[0]) + _shards(nodes[1])
    assert verify_store(out) == [] and len(open_store(out)) == 20 and (out / PLAN_NAME).exists()
    assert [f.stat().st_ino for f in placed] == inodes  # the 3 shards in place were kept, not copied again
    again = merge_stores(out, list(nodes), copy=True, progress=False)  # the same merge tidies up, says it is done
    assert (again.shards, again.copied, again.kept) == (total, 0, total) and not (out / PLAN_NAME).exists()
    assert merge_stores(tmp_path / "fresh", list(nodes), copy=True, progress=False).copied == total
    assert load_manifest(out / MANIFEST_NAME).shards == load_manifest(tmp_path / "fresh" / MANIFEST_NAME).shards


def test_refusals_are_one_line_and_name_the_store(nodes, tmp_path, meta):
    a, b = nodes

    def refused(match: str, stores, out) -> None:
        with pytest.raises(HstapError, match=match) as err:
            merge_stores(out, stores, progress=False)
        assert "\n" not in str(err.value)

    refused("'s0' is in .*node0 and in .*node0 \\(12 sample", [a, a], tmp_path / "twice")
    write_samples(tmp_path / "other", meta.model_copy(update={"model_fingerprint": "def456"}), range(30, 31))
    refused("other: meta.model_fingerprint is def456, .*node0 has abc123", [a, tmp_path / "other"], tmp_path / "x")
    write_samples(tmp_path / "cut", meta.model_copy(update={"extra": {"loops": "cut"}}), range(40, 41))
    refused("cut: captured with loops='cut', .*node0 with None", [a, tmp_path / "cut"], tmp_path / "y")
    refused("is one of the input stores", [a, b], a)
    merge_stores(tmp_path / "done", [a, b], progress=False)
    refused("already holds a store", [a, b], tmp_path / "done")
    refused("1 input store given", [a], tmp_path / "one")
    (b / load_manifest(b / MANIFEST_NAME).shards[0].file).unlink()
    refused("node1: .*missing", [a, b], tmp_path / "z")


def test_two_real_captures_merged_train_like_the_one_store(small_store, tmp_path):
    """Real SmolLM2 states: the small capture's samples split between two nodes' stores (written by the store
    writer, several shards each), merged back: every sample bitwise the original's, and 2 training steps on the
    merge give the losses of 2 steps on the original."""
    from hstap.train.config import TrainConfig
    from hstap.train.run import load_metrics, run_train

    original = open_store(small_store)
    halves = [range(0, 24), range(24, len(original))]
    for n, part in enumerate(halves):
        with StoreWriter(tmp_path / f"node{n}", original.manifest.meta, shard_bytes=1 << 20) as w:
            for i in part:
                sample = original.read(i, dequantize=False)
                w.add(sample["id"], _flat(sample))
    merge_stores(tmp_path / "all", [tmp_path / "node0", tmp_path / "node1"], progress=False)
    merged = open_store(tmp_path / "all")
    assert merged.ids() == original.ids() and len(merged.manifest.shards) > 2
    for i in range(len(original)):
        a, b = merged[i], original[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in b["hidden"]:
            assert torch.equal(a["hidden"][k], b["hidden"][k])
        for k in b["teacher"]:
            assert torch.equal(a["teacher"][k], b["teacher"][k])

    common = dict(max_steps=2, epochs=1, batch_tokens=512, draft_vocab=2048, ttt_steps=2, heldout=0.05,
                  calib_prompts=0)
    losses = []
    for name, store in (("on_merged", tmp_path / "all"), ("on_original", small_store)):
        run_train(TrainConfig(store=store, out=tmp_path / name, **common), progress=False)
        losses.append([r["loss"] for r in load_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"])
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def _flat(sample: dict) -> dict[str, torch.Tensor]:
    """A read sample back in the writer's flat names (hidden.K, teacher.NAME)."""
    flat = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
    flat.update({f"hidden.{k}": v for k, v in sample["hidden"].items()})
    flat.update({f"teacher.{k}": v for k, v in sample["teacher"].items()})
    return flat
