"""verify_store catches every kind of damage and names the shard; check_free_space refuses or warns."""

from __future__ import annotations

import json

import pytest

from hstap.config import TeacherSpec
from hstap.errors import HstapError
from hstap.store import bytes_per_token, check_free_space, open_store, verify_store
from hstap.store.estimate import conventional_specs, human_bytes
from tests.store.conftest import write_samples


@pytest.fixture
def store_dir(tmp_path, meta):
    write_samples(tmp_path, meta, range(20), shard_bytes=8 << 10)
    assert len(open_store(tmp_path).manifest.shards) >= 3
    return tmp_path


def _shard(store_dir, i: int):
    return store_dir / open_store(store_dir).manifest.shards[i].file


def test_clean_store_verifies(store_dir):
    assert verify_store(store_dir) == []


def test_flipped_byte_names_exactly_that_shard(store_dir):
    f = _shard(store_dir, 1)
    data = bytearray(f.read_bytes())
    data[len(data) - 3] ^= 0x01  # in the tensor data, past the header
    f.write_bytes(bytes(data))
    problems = verify_store(store_dir)
    assert len(problems) == 1 and problems[0].startswith(f"{f.name}: sha256 mismatch")


def test_truncated_shard(store_dir):
    f = _shard(store_dir, 2)
    f.write_bytes(f.read_bytes()[:-100])
    problems = verify_store(store_dir)
    assert len(problems) == 1 and problems[0].startswith(f"{f.name}:") and "truncated" in problems[0]


def test_missing_shard(store_dir):
    f = _shard(store_dir, 0)
    listed = len(open_store(store_dir).manifest.shards[0].samples)
    f.unlink()
    assert verify_store(store_dir) == [f"{f.name}: missing ({listed} samples listed in it)"]


def test_totals_mismatch(store_dir):
    m = store_dir / "manifest.json"
    data = json.loads(m.read_text())
    data["totals"]["tokens"] += 1
    m.write_text(json.dumps(data))
    problems = verify_store(store_dir)
    assert len(problems) == 1 and problems[0].startswith("manifest.json: totals") and "tokens" in problems[0]


def test_manifest_lengths_disagree_with_shard(store_dir):
    m = store_dir / "manifest.json"
    data = json.loads(m.read_text())
    shard = data["shards"][1]
    shard["samples"][0]["length"] += 1
    m.write_text(json.dumps(data))
    problems = verify_store(store_dir)
    assert problems and all(p.startswith(shard["file"]) for p in problems)


def test_unlisted_shard_is_reported_other_files_are_not(store_dir):
    (store_dir / "notes.txt").write_text("a user's file")
    assert verify_store(store_dir) == []
    (store_dir / "shard-00077.safetensors").write_bytes(b"junk")
    problems = verify_store(store_dir)
    assert len(problems) == 1 and problems[0].startswith("shard-00077.safetensors: on disk but not listed")


def test_bytes_per_token_matches_disk(store_dir, meta):
    store = open_store(store_dir)
    bpt = bytes_per_token(store.manifest.tensors)
    assert bpt == 4 + 1 + 3 * 16 * 2 + 4 * 4 + 4 * 4
    # these test samples carry fp32 log-probs; a capture stores them as fp16, which is what the estimate assumes
    assert bytes_per_token(conventional_specs(meta)) == bpt - 4 * 2, "top-k log-probs are fp16"
    # on disk: the same plus the safetensors header per shard
    assert store.manifest.totals.bytes > bpt * store.manifest.totals.tokens


def test_check_free_space(tmp_path):
    out = tmp_path / "not" / "yet"
    assert check_free_space(out, 1000) is None
    pattern = rf"need ~[\d.]+ TB in {out}, only [\d.]+ [kMGT]?B free: free space or pass --force"
    with pytest.raises(HstapError, match=pattern):
        check_free_space(out, 10**18)
    warning = check_free_space(out, 10**18, force=True)
    assert warning is not None and "--force" in warning and not out.exists()


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1_500_000_000) == "1.5 GB"
    assert human_bytes(3.2e13) == "32.0 TB"


def test_conventional_specs_teacher_kinds(meta):
    hidden = conventional_specs(meta.model_copy(update={"teacher": TeacherSpec.parse("hidden")}))
    assert hidden["teacher.hidden"].dtype == "bf16" and hidden["teacher.hidden"].shape == [16]
    assert "teacher.topk_ids" not in hidden and conventional_specs(meta)["teacher.topk_ids"].shape == [4]
    with pytest.raises(HstapError, match="--teacher: expected 'topk:K' .* or 'hidden', got 'logits'"):
        TeacherSpec.parse("logits")
