"""Store reader: indexing, laziness (only the needed shard, only the needed rows), errors, info."""

from __future__ import annotations

import pickle

import pytest
import torch

import hstap.store.reader as reader
from hstap.errors import HstapError
from hstap.store import open_store, store_info
from tests.store.conftest import LAYERS, assert_sample_equal, make_sample, write_samples


class _CountingOpen:
    """Wraps safetensors.safe_open: records which files open and which row slices are read."""

    def __init__(self, real):
        self.real, self.files, self.slices = real, [], []

    def __call__(self, file, framework):
        self.files.append(file.rsplit("/", 1)[-1])
        handle = self.real(file, framework=framework)
        outer = self

        class Handle:
            def __getattr__(self, name):
                return getattr(handle, name)

            def get_slice(self, name):
                sl = handle.get_slice(name)

                class Slice:
                    def __getitem__(self, key):
                        outer.slices.append(key)
                        return sl[key]

                return Slice()

        return Handle()


@pytest.fixture
def store_dir(tmp_path, meta):
    write_samples(tmp_path, meta, range(30), shard_bytes=16 << 10)
    return tmp_path


def test_indexing(store_dir):
    store = open_store(store_dir)
    assert len(store) == 30
    assert store[-1]["id"] == "s29" and store[-30]["id"] == "s0"
    with pytest.raises(IndexError):
        store[30]
    with pytest.raises(IndexError):
        store[-31]
    assert store.index_of("s17") == 17
    with pytest.raises(KeyError, match="s999"):
        store.index_of("s999")
    got = store[5]
    assert set(got) == {"id", "input_ids", "loss_mask", "hidden", "teacher"}
    assert list(got["hidden"]) == LAYERS and set(got["teacher"]) == {"topk_ids", "topk_logprobs"}
    assert got["hidden"][14].shape == (len(got["input_ids"]), 16)


def test_open_reads_no_shard_and_getitem_reads_only_its_rows(store_dir, monkeypatch):
    spy = _CountingOpen(reader.safe_open)
    monkeypatch.setattr(reader, "safe_open", spy)
    store = open_store(store_dir)
    assert len(store) == 30 and spy.files == [], "opening a store reads the manifest only"

    i = 20
    shard_idx, entry = store._index[i]
    assert shard_idx > 0, "pick a sample beyond the first shard"
    assert_sample_equal(store[i], make_sample(i))
    assert spy.files == [store.manifest.shards[shard_idx].file]
    rows = slice(entry.offset, entry.offset + entry.length)
    assert spy.slices == [rows] * len(store.manifest.tensors)

    store[i]
    assert len(spy.files) == 1, "the open handle is cached"


def test_handle_cache_is_bounded(store_dir, monkeypatch):
    spy = _CountingOpen(reader.safe_open)
    monkeypatch.setattr(reader, "safe_open", spy)
    store = open_store(store_dir)
    list(store)
    assert len(spy.files) == len(store.manifest.shards), "sequential reads open each shard once"
    assert len(store._handles) <= reader.OPEN_SHARDS


def test_extra_tensor_names_pass_through(tmp_path, meta):
    from hstap.store import StoreWriter

    with StoreWriter(tmp_path, meta) as w:
        sample = make_sample(0, length=5)
        sample["position_ids"] = torch.arange(5)
        w.add("x", sample)
    got = open_store(tmp_path)[0]
    assert torch.equal(got["position_ids"], torch.arange(5)) and got["position_ids"].dtype == torch.int64


def test_missing_manifest(tmp_path):
    with pytest.raises(HstapError, match=f"no manifest.json in {tmp_path}: not an hstap store"):
        open_store(tmp_path)


def test_bad_manifest_errors_name_file_and_field(tmp_path, store_dir):
    text = (store_dir / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text.replace('"schema_version":1', '"schema_version":7'))
    with pytest.raises(HstapError, match=r"manifest.json: schema_version=7, this hstap reads 1"):
        open_store(tmp_path)
    (tmp_path / "manifest.json").write_text(text[:-10])
    with pytest.raises(HstapError, match=r"manifest.json: invalid JSON at line 1"):
        open_store(tmp_path)
    (tmp_path / "manifest.json").write_text(text.replace('"hidden_size":16', '"hidden_size":"big"'))
    with pytest.raises(HstapError, match=r"manifest.json: field meta.hidden_size"):
        open_store(tmp_path)


def test_missing_shard_on_read(store_dir):
    store = open_store(store_dir)
    (store_dir / store.manifest.shards[0].file).unlink()
    with pytest.raises(HstapError, match=r"shard-00000.safetensors: missing \(\d+ samples listed in it\)") as e:
        store[0]
    assert "\n" not in str(e.value)


def test_pickles_without_handles(store_dir):
    store = open_store(store_dir)
    store[0]
    clone = pickle.loads(pickle.dumps(store))
    assert clone.ids() == store.ids()
    assert_sample_equal(clone[3], make_sample(3))


def test_store_info(store_dir):
    info = store_info(store_dir)
    files = sorted(store_dir.glob("shard-*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    assert info["samples"] == 30 and info["shards"] == len(files)
    assert info["tokens"] == sum(len(make_sample(i)["input_ids"]) for i in range(30))
    assert info["bytes_on_disk"] == on_disk
    assert info["bytes_per_token"] == pytest.approx(on_disk / info["tokens"])
    assert info["layer_ids"] == LAYERS and info["hidden_size"] == 16 and info["hidden_dtype"] == "bf16"
    assert info["teacher"] == "topk:4"
    assert info["model_id"] == "test/tiny" and info["model_fingerprint"] == "abc123"


def test_read_selected_keys_only(tmp_path):
    import torch

    from hstap.store import StoreMeta, StoreWriter, open_store

    meta = StoreMeta(model_id="m", model_fingerprint="f", layer_ids=[1], hidden_size=4, hidden_dtype="fp32",
                     teacher="hidden")
    with StoreWriter(tmp_path, meta) as w:
        w.add("a", {"input_ids": torch.arange(3, dtype=torch.int32), "loss_mask": torch.tensor([0, 1, 1]).bool(),
                    "hidden.1": torch.randn(3, 4), "teacher.hidden": torch.randn(3, 4)})
    sample = open_store(tmp_path).read(0, keys={"input_ids", "loss_mask"})
    assert sample["input_ids"].tolist() == [0, 1, 2] and sample["loss_mask"].tolist() == [False, True, True]
    assert sample["hidden"] == {} and sample["teacher"] == {}
