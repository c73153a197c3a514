"""StoreWriter: round trip, sharding, resume, crash leftovers, validation messages."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from hstap.errors import HstapError
from hstap.store import StoreWriter, open_store, verify_store
from hstap.store.writer import StoreWriteError
from hstap.store.manifest import load_manifest
from tests.store.conftest import assert_sample_equal, make_sample, write_samples


def test_round_trip_across_shards(tmp_path, meta):
    write_samples(tmp_path, meta, range(50), shard_bytes=16 << 10)
    store = open_store(tmp_path)
    assert len(store.manifest.shards) >= 4, "small shard_bytes should give several shards"
    assert store.ids() == [f"s{i}" for i in range(50)]
    for i, got in enumerate(store):
        assert got["id"] == f"s{i}"
        assert_sample_equal(got, make_sample(i))
    specs = store.manifest.tensors
    assert specs["input_ids"].dtype == "int32", "input_ids are narrowed to int32 on disk"
    assert specs["hidden.14"].dtype == "bf16" and specs["hidden.14"].shape == [16]
    assert store.manifest.meta == meta


def test_shard_commits_when_buffer_reaches_shard_bytes(tmp_path, meta):
    one = sum(t.nbytes for t in make_sample(0, length=10).values()) - 10 * 4  # input_ids shrink int64 -> int32
    with StoreWriter(tmp_path, meta, shard_bytes=2 * one) as w:
        w.add("a", make_sample(0, length=10))
        assert load_manifest(tmp_path / "manifest.json").shards == []
        w.add("b", make_sample(1, length=10))
        shards = load_manifest(tmp_path / "manifest.json").shards
        assert [[e.id for e in s.samples] for s in shards] == [["a", "b"]]
        assert [(e.offset, e.length) for e in shards[0].samples] == [(0, 10), (10, 10)]
        w.add("c", make_sample(2, length=5))
    shards = load_manifest(tmp_path / "manifest.json").shards
    assert [s.file for s in shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert shards[1].num_tokens == 5, "close() flushes the partial buffer"


def test_add_copies_caller_buffers(tmp_path, meta):
    sample = make_sample(0)
    want = {k: v.clone() for k, v in sample.items()}
    with StoreWriter(tmp_path, meta) as w:
        w.add("x", sample)
        for t in sample.values():
            t.zero_()  # a capture loop reuses its pinned buffers right after add()
    assert_sample_equal(open_store(tmp_path)[0], want)


def test_resume_skips_committed_and_appends(tmp_path, meta):
    write_samples(tmp_path, meta, range(20))
    n_shards = len(load_manifest(tmp_path / "manifest.json").shards)
    resumed = meta.model_copy(update={"extra": {"max_len": 128}})  # extra is not compared
    with StoreWriter(tmp_path, resumed, shard_bytes=4096) as w:
        assert w.committed_ids == {f"s{i}" for i in range(20)}
        assert w.cleaned == []
        for i in range(30):
            if f"s{i}" not in w.committed_ids:
                w.add(f"s{i}", make_sample(i))
    store = open_store(tmp_path)
    assert store.ids() == [f"s{i}" for i in range(30)]
    files = [s.file for s in store.manifest.shards]
    assert len(set(files)) == len(files)
    assert files[n_shards] == f"shard-{n_shards:05d}.safetensors", "new shards continue the numbering"
    assert store.manifest.totals.samples == 30
    assert store.manifest.totals.tokens == sum(s.num_tokens for s in store.manifest.shards)
    for i in (0, 19, 20, 29):
        assert_sample_equal(store[store.index_of(f"s{i}")], make_sample(i))


def test_resume_with_other_layer_ids_refused(tmp_path, meta):
    write_samples(tmp_path, meta, range(3))
    other = meta.model_copy(update={"layer_ids": [2, 14, 26]})
    with pytest.raises(HstapError, match=r"layer_ids=\[1, 14, 26\], this run asks \[2, 14, 26\]") as e:
        StoreWriter(tmp_path, other)
    assert str(tmp_path) in str(e.value) and "hidden_size" not in str(e.value)
    StoreWriter(tmp_path, meta).close()  # the refused writer released its lock


def test_resume_names_every_differing_field(tmp_path, meta):
    write_samples(tmp_path, meta, range(1))
    other = meta.model_copy(update={"hidden_dtype": "fp32", "model_fingerprint": "zzz"})
    with pytest.raises(HstapError, match="model_fingerprint=abc123, this run asks zzz.*hidden_dtype=bf16"):
        StoreWriter(tmp_path, other)


def test_crash_leftovers_removed_and_reported(tmp_path, meta):
    write_samples(tmp_path, meta, range(10))
    listed = {s.file for s in load_manifest(tmp_path / "manifest.json").shards}
    after_last = f"shard-{len(listed):05d}.safetensors"  # renamed, but the crash came before the manifest update
    (tmp_path / after_last).write_bytes((tmp_path / sorted(listed)[0]).read_bytes())
    (tmp_path / "shard-00100.safetensors.tmp").write_bytes(b"half a shard")
    (tmp_path / "manifest.json.tmp").write_text("{")
    (tmp_path / "notes.txt").write_text("user file")

    assert len(open_store(tmp_path)) == 10, "the reader ignores unlisted shards"
    with StoreWriter(tmp_path, meta, shard_bytes=4096) as w:
        assert sorted(w.cleaned) == ["manifest.json.tmp", after_last, "shard-00100.safetensors.tmp"]
        w.add("new", make_sample(100))
    assert (tmp_path / "notes.txt").exists(), "only the store's own files are cleaned"
    store = open_store(tmp_path)
    assert store.ids()[-1] == "new" and len(store) == 11
    new_file = store.manifest.shards[-1].file
    assert new_file == after_last and new_file not in listed
    names = {p.name for p in tmp_path.iterdir()}
    assert names == listed | {new_file, "manifest.json", ".writer.lock", "notes.txt"}


def test_empty_store_opens_with_zero_samples(tmp_path, meta):
    out = tmp_path / "a" / "b"
    StoreWriter(out, meta).close()
    store = open_store(out)
    assert len(store) == 0 and list(store) == [] and store.manifest.totals.samples == 0


def test_second_writer_refused(tmp_path, meta):
    with StoreWriter(tmp_path, meta):
        with pytest.raises(HstapError, match="another writer"):
            StoreWriter(tmp_path, meta)


def _bad(**changes) -> dict[str, torch.Tensor]:
    sample = make_sample(7, length=6)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del sample[name]
        else:
            sample[name] = value
    return sample


@pytest.mark.parametrize(
    "tensors, pattern",
    [
        (_bad(teacher__topk_ids=None), r"'bad-1'.*missing \['teacher.topk_ids'\]"),
        (_bad(extra_thing=torch.zeros(6)), r"'bad-1'.*unexpected \['extra_thing'\]"),
        (_bad(hidden__14=torch.zeros(6, 16)), r"'bad-1'.*'hidden.14' has dtype fp32, the store has bf16"),
        (_bad(loss_mask=torch.ones(7, dtype=torch.bool)), r"'bad-1'.*'loss_mask' has 7 tokens"),
        (_bad(hidden__1=torch.zeros(6, 8, dtype=torch.bfloat16)), r"'bad-1'.*'hidden.1' has per-token shape \[8\]"),
        (_bad(input_ids=torch.rand(6)), r"'bad-1'.*'input_ids' has dtype fp32"),
        (_bad(input_ids=torch.full((6,), 2**40)), r"'bad-1'.*'input_ids' has ids outside int32"),
    ],
)
def test_validation_errors_name_sample_and_tensor(tmp_path, meta, tensors, pattern):
    with StoreWriter(tmp_path, meta) as w:
        w.add("good", make_sample(0))
        with pytest.raises(HstapError, match=pattern):
            w.add("bad-1", tensors)
        w.add("bad-1", make_sample(1))  # a refused sample leaves no trace
    assert open_store(tmp_path).ids() == ["good", "bad-1"]


def test_duplicate_ids_refused_buffered_and_committed(tmp_path, meta):
    with StoreWriter(tmp_path, meta, shard_bytes=1 << 30) as w:
        w.add("dup", make_sample(0))
        with pytest.raises(HstapError, match="'dup' is already in the store"):
            w.add("dup", make_sample(1))
    with StoreWriter(tmp_path, meta) as w:
        with pytest.raises(HstapError, match="'dup' is already in the store"):
            w.add("dup", make_sample(1))


def test_first_sample_checked_against_meta(tmp_path, meta):
    sample = make_sample(0)
    sample["hidden.2"] = sample.pop("hidden.1")
    with StoreWriter(tmp_path, meta) as w:
        with pytest.raises(HstapError, match=r"'s0'.*hidden.2.*layer_ids=\[1, 14, 26\]"):
            w.add("s0", sample)


def test_failed_manifest_write_leaves_the_store_as_it_was(tmp_path, meta, monkeypatch):
    """The manifest write fails after the shard is renamed: the shard goes too (no space stays taken), the store is
    as it was, and the writer keeps the buffer (a later flush may succeed)."""
    write_samples(tmp_path, meta, range(3))
    before = (tmp_path / "manifest.json").read_text()

    def fail(path, manifest):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("hstap.store.writer.save_manifest", fail)
    w = StoreWriter(tmp_path, meta)
    w.add("late", make_sample(9))
    with pytest.raises(StoreWriteError, match="Input/output error writing manifest.json.*keeps its 3 committed") as e:
        w.flush()
    assert "\n" not in str(e.value)
    assert (tmp_path / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [s["file"] for s in json.loads(before)["shards"]]
    monkeypatch.undo()
    w.close()  # the retry commits what the failed flush kept
    assert open_store(tmp_path).ids() == ["s0", "s1", "s2", "late"]
    assert verify_store(tmp_path) == []
