"""A store that is not as its manifest says — lost manifest, deleted, truncated or flipped shard, unlisted shard,
a manifest that is not JSON or lacks a key, a full disk — is rebuilt, refused or repaired, and every command names
the shard or field in one line. Nothing here deletes a shard that holds committed samples."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import save_file

from hstap import faults
from hstap.cli import main
from hstap.config import TeacherSpec
from hstap.errors import HstapError
from hstap.store import StoreWriter, open_store, store_info, verify_store
from hstap.store.writer import StoreWriteError
from tests.store.conftest import assert_sample_equal, make_sample, write_samples

N = 20


@pytest.fixture
def store(tmp_path, meta):
    out = tmp_path / "store"
    write_samples(out, meta, range(N), shard_bytes=8 << 10)
    assert len(open_store(out).manifest.shards) >= 3
    return out


def _shard(store, i: int):
    return store / open_store(store).manifest.shards[i].file


def _flip(file, at: int = -3) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01  # in the tensor data, past the header
    file.write_bytes(bytes(data))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hstap: error: "), err
    return err


# ---- commits on a timer --------------------------------------------------------------------------------------------

def test_commit_every_counts_from_the_last_commit_so_a_finished_batch_is_kept_at_once(tmp_path, meta):
    """Issue 43: with --commit-every 5s the first batch finished at ~8 s and a kill at 17 s left nothing: the
    interval was checked when a sample arrived, against the oldest buffered one, so commits came one batch late.
    Now `commit_if_due` (capture calls it once a whole batch is in) measures from the last commit or the opening:
    a batch finished after the interval is committed right then, all of it."""
    clock = {"now": 0.0}
    w = StoreWriter(tmp_path, meta, shard_bytes=1 << 30, commit_every_s=5, clock=lambda: clock["now"])
    clock["now"] = 8.0  # the first batch (two samples) is done
    w.add("a", make_sample(0))
    w.add("b", make_sample(1))
    assert open_store(tmp_path).ids() == [], "add commits on size only: never half a batch"
    assert w.commit_if_due() and open_store(tmp_path).ids() == ["a", "b"]
    clock["now"] = 12.0
    w.add("c", make_sample(2))
    assert not w.commit_if_due() and len(open_store(tmp_path)) == 2, "4 s since the last commit"
    clock["now"] = 13.0
    w.add("d", make_sample(3))
    assert w.commit_if_due() and open_store(tmp_path).ids() == ["a", "b", "c", "d"]
    clock["now"] = 30.0
    assert not w.commit_if_due(), "nothing buffered, nothing to commit"
    w.close()
    assert len(open_store(tmp_path).manifest.shards) == 2


def test_a_store_that_holds_no_sample_takes_the_next_runs_settings(tmp_path, meta):
    """Issue 43: `capture --teacher topk:100000` failed before its first commit and its empty store pinned k, so the
    corrected command was refused. A store with no shard (listed or on disk) now takes the next run's settings; once
    it holds a sample, or a shard an interrupted first commit left, other settings are refused as before."""
    wrong = meta.model_copy(update={"teacher": TeacherSpec.parse("topk:100000")})
    StoreWriter(tmp_path / "s", wrong).close()  # what the failed run left: a manifest and nothing else
    with StoreWriter(tmp_path / "s", meta) as w:
        assert w.notes == ["the store held no sample: its settings were replaced (teacher={'kind': 'topk', 'k': "
                           "100000}, this run asks {'kind': 'topk', 'k': 4})"]
        w.add("a", make_sample(0))
    assert open_store(tmp_path / "s").manifest.meta == meta
    with pytest.raises(HstapError, match="was captured with teacher="):
        StoreWriter(tmp_path / "s", wrong)

    with StoreWriter(tmp_path / "t", meta) as w:  # a first commit killed between the shard's rename and the manifest
        w.add("a", make_sample(0))
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    manifest.update(shards=[], totals={"samples": 0, "tokens": 0, "bytes": 0})
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HstapError, match="was captured with teacher="):
        StoreWriter(tmp_path / "t", wrong)
    assert (tmp_path / "t" / "shard-00000.safetensors").exists()


# ---- a lost manifest -----------------------------------------------------------------------------------------------

def test_lost_manifest_is_rebuilt_from_shard_headers_never_deleted(store, meta, capsys):
    before = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").unlink()
    assert main(["store", "verify", str(store)]) == 2
    assert "re-run the same `hstap capture` command on it to rebuild" in _one_line_error(capsys)

    with StoreWriter(store, meta, shard_bytes=8 << 10) as w:
        assert w.committed_ids == {f"s{i}" for i in range(N)} and w.cleaned == []
        assert w.notes == [f"rebuilt manifest.json from the headers of {len(before['shards'])} shards ({N} samples)"]
        w.add("s20", make_sample(20))
    after = json.loads((store / "manifest.json").read_text())
    assert after["shards"][:-1] == before["shards"] and after["tensors"] == before["tensors"]
    assert verify_store(store) == []
    reread = open_store(store)
    assert reread.ids() == [f"s{i}" for i in range(N + 1)]
    assert_sample_equal(reread[7], make_sample(7))


def test_lost_manifest_with_other_settings_is_refused_and_kept(store, meta):
    (store / "manifest.json").unlink()
    shards = sorted(p.name for p in store.glob("shard-*"))
    with pytest.raises(HstapError, match=r"has no manifest.json and shard-00000.safetensors was captured with "
                                         r"layer_ids=\[1, 14, 26\], this run asks \[2, 14, 26\]"):
        StoreWriter(store, meta.model_copy(update={"layer_ids": [2, 14, 26]}))
    assert sorted(p.name for p in store.glob("shard-*")) == shards and not (store / "manifest.json").exists()


def test_lost_manifest_with_shards_that_predate_the_meta_header_is_refused(tmp_path, meta):
    sample = make_sample(0, length=5)
    sample["input_ids"] = sample["input_ids"].int()
    save_file(sample, str(tmp_path / "shard-00000.safetensors"), metadata={"samples": '[["s0", 0, 5]]'})
    with pytest.raises(HstapError, match="shard-00000.safetensors was written before shards carried their capture"):
        StoreWriter(tmp_path, meta)
    assert (tmp_path / "shard-00000.safetensors").exists()


# ---- resume on a damaged store -------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, needle", [
    (lambda f: f.unlink(), "missing"),
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), "truncated"),
])
def test_resume_on_a_damaged_shard_is_refused_naming_it(store, meta, damage, needle):
    f = _shard(store, 1)
    damage(f)
    with pytest.raises(HstapError, match=rf"cannot be resumed: {f.name}: .*{needle}.*--repair") as e:
        StoreWriter(store, meta)
    assert "\n" not in str(e.value)
    with StoreWriter(store, meta, shard_bytes=8 << 10, repair=True) as w:
        lost = {f"s{i}" for i in range(N)} - w.committed_ids
        assert lost and w.notes[0].startswith(f"set aside {f.name}")
        for sid in sorted(lost, key=lambda s: int(s[1:])):
            w.add(sid, make_sample(int(sid[1:])))  # what `hstap capture --repair` does: capture them again
    assert verify_store(store) == []
    reread = open_store(store)
    assert sorted(reread.ids()) == sorted(f"s{i}" for i in range(N))
    assert_sample_equal(reread[reread.index_of("s3")], make_sample(3))


def test_repair_sets_a_flipped_shard_aside_keeping_the_file(store, meta):
    f = _shard(store, 0)
    _flip(f)
    with StoreWriter(store, meta) as w:  # the cheap resume check (sizes) cannot see a flipped byte...
        assert len(w.committed_ids) == N
    with StoreWriter(store, meta, repair=True) as w:  # ...the repair hashes every shard
        assert "sha256 mismatch" in w.notes[0] and len(w.committed_ids) < N
    assert (store / (f.name + ".damaged")).exists() and verify_store(store) == []


def test_shard_an_interrupted_commit_left_unlisted_is_kept(tmp_path, meta, monkeypatch):
    """Killed between the shard's rename and the manifest update: the shard is whole (fsynced before the rename),
    so the next writer lists it instead of deleting it and capturing its samples again."""
    write_samples(tmp_path, meta, range(3))
    w = StoreWriter(tmp_path, meta)
    w.add("late", make_sample(9))

    def killed(path, manifest):
        raise KeyboardInterrupt  # as a kill at fault point `shard-renamed` would stop it

    monkeypatch.setattr("hstap.store.writer.save_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        w.flush()
    monkeypatch.undo()
    os.close(w._lock_fd)  # the process is gone: its lock with it
    assert "late" not in open_store(tmp_path).ids() and verify_store(tmp_path)[0].endswith("older than the shards)")
    with StoreWriter(tmp_path, meta) as w2:
        assert "late" in w2.committed_ids and w2.cleaned == [] and w2.notes[0].startswith("kept shard-")
    assert open_store(tmp_path).ids() == ["s0", "s1", "s2", "late"] and verify_store(tmp_path) == []
    assert_sample_equal(open_store(tmp_path)[3], make_sample(9))


def test_unlisted_shard_that_no_commit_leaves_is_refused_not_deleted(store, meta):
    stray = store / "shard-00077.safetensors"
    shutil.copy(_shard(store, 0), stray)
    with pytest.raises(HstapError, match="shard-00077.safetensors is on disk but not listed in manifest.json"):
        StoreWriter(store, meta)
    assert stray.exists()


# ---- every command names the damage in one line --------------------------------------------------------------------

DAMAGES = {
    "flipped": lambda f: _flip(f),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:-100]),
    "deleted": lambda f: f.unlink(),
}


@pytest.mark.parametrize("kind", DAMAGES)
def test_verify_info_and_open_store_name_the_damaged_shard(store, kind, capsys):
    f = _shard(store, 1)
    DAMAGES[kind](f)
    assert main(["store", "verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert out.count("BAD") == 1 and f"BAD {f.name}:" in out
    info_code = main(["store", "info", str(store)])
    out = capsys.readouterr().out
    if kind == "flipped":  # info reads no shard: a flipped byte is verify's (and the reader's) to find
        assert info_code == 0 and "BAD" not in out
        store_obj = open_store(store)
        store_obj.read(store_obj.index_of(store_obj.manifest.shards[1].samples[0].id), keys={"input_ids"})
        with pytest.raises(HstapError, match=rf"{f.name}: sha256 mismatch.*--skip-bad-shards") as e:
            store_obj[store_obj.index_of(store_obj.manifest.shards[1].samples[0].id)]
    else:
        assert info_code == 1 and out.count("BAD") == 1 and f"BAD {f.name}:" in out
        with pytest.raises(HstapError, match=rf"{f.name}: (missing|.*truncated)") as e:
            open_store(store)
    assert "\n" not in str(e.value)


def test_skip_bad_shards_leaves_them_out_and_counts_them(store):
    bad = [_shard(store, 0), _shard(store, 2)]
    whole = open_store(store).manifest
    _flip(bad[0])
    bad[1].write_bytes(bad[1].read_bytes()[:-10])
    lost = {e.id for s in whole.shards if s.file in {b.name for b in bad} for e in s.samples}
    kept = open_store(store, skip_bad_shards=True)
    assert [s.file for s in kept.skipped] == [b.name for b in bad]
    assert sum(s.samples for s in kept.skipped) == len(lost) and "sha256" in kept.skipped[0].problem
    assert set(kept.ids()) == {f"s{i}" for i in range(N)} - lost
    for sample in kept:
        assert_sample_equal(sample, make_sample(int(sample["id"][1:])))


def test_info_does_not_trust_the_totals_and_names_an_unlisted_shard(store, capsys):
    m = store / "manifest.json"
    data = json.loads(m.read_text())
    data["totals"]["samples"] = 999
    m.write_text(json.dumps(data))
    shutil.copy(_shard(store, 0), store / "shard-00077.safetensors")
    info = store_info(store)
    assert info["samples"] == N
    assert [p.split(":")[0] for p in info["problems"]] == ["manifest.json", "shard-00077.safetensors"]
    assert "totals say 999 samples" in info["problems"][0]
    assert main(["store", "info", str(store)]) == 1
    assert capsys.readouterr().out.count("BAD") == 2


@pytest.mark.parametrize("text, needle", [
    ("{not json", "invalid JSON at line 1"),
    (b"\x80\x81garbage", "not JSON text"),
    ("", "invalid JSON"),
    ("[]", "expected a JSON object"),
    (None, "field totals: missing"),
])
def test_bad_manifest_is_one_line_in_every_command(store, text, needle, capsys):
    m = store / "manifest.json"
    if text is None:
        data = json.loads(m.read_text())
        del data["totals"]
        m.write_text(json.dumps(data))
    elif isinstance(text, bytes):
        m.write_bytes(text)
    else:
        m.write_text(text)
    for argv in (["store", "verify", str(store)], ["store", "info", str(store)], ["compare", str(store), str(store)]):
        assert main(argv) == 2
        err = _one_line_error(capsys)
        assert "manifest.json" in err and needle in err, err
    with pytest.raises(HstapError, match=needle):
        open_store(store)


# ---- a full disk ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("point", ["shard-write", "manifest-write"])
def test_full_disk_mid_commit_leaves_a_store_that_verifies_and_resumes(tmp_path, meta, monkeypatch, point):
    out = tmp_path / "store"
    write_samples(out, meta, range(5), shard_bytes=8 << 10)
    before = sorted(p.name for p in out.iterdir())
    faults.reset()
    monkeypatch.setenv("HSTAP_FAULT", f"{point}:1:ENOSPC")
    w = StoreWriter(out, meta, shard_bytes=1 << 30)
    for i in range(5, 8):
        w.add(f"s{i}", make_sample(i))
    with pytest.raises(StoreWriteError, match="No space left on device writing .*keeps its 5 committed samples: "
                                              "free space and re-run") as e:
        w.flush()
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == before, "no .tmp, no unlisted shard left taking space"
    assert verify_store(out) == [] and len(open_store(out)) == 5
    w.close()  # space back (the fault fires once): the buffer the failed commit kept now commits
    assert open_store(out).ids() == [f"s{i}" for i in range(8)] and verify_store(out) == []


def test_out_that_is_a_file_is_one_line(tmp_path, meta):
    (tmp_path / "f").write_text("x")
    with pytest.raises(HstapError, match=r"store .*f: cannot create the directory \(File exists\)"):
        StoreWriter(tmp_path / "f", meta)
