"""A drafter's weights carry a checksum (written by save_pretrained) and every command that loads them checks it,
the safetensors header and that every weight is finite: a truncated, empty or header-damaged model.safetensors, a
flipped byte and a NaN in fc.weight are each one line naming the file, exit 2, in `hstap eval --drafter`, `hstap
serve --engine hf --drafter` (said once, before any engine starts), `hstap export` and `hstap train --init-from`.
Before: SafetensorError tracebacks for the first three, and the last two loaded silently (τ 1.00 for the NaN)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hstap.cli import main
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.drafter.integrity import CHECKSUM, load_weights, sha256_file, verify_checksum
from hstap.errors import HstapError

LAYERS = [1, 14, 26]


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _empty(data: bytes) -> bytes:
    return b""


def _bad_header(data: bytes) -> bytes:
    return data[:8] + b"\x07garbage" + data[16:]  # same length: the header's JSON broken


def _flip(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[-5] ^= 0x10  # a weight's byte: a valid file of wrong numbers
    return bytes(flipped)


@pytest.fixture(scope="module")
def good(target, tmp_path_factory) -> Path:
    """An untrained SmolLM2 drafter as save_pretrained writes it (no embedding: 23 MB, not 136)."""
    out = tmp_path_factory.mktemp("drafter") / "good"
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target.model.config, LAYERS, 512, target.model_id, target.fingerprint)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target.model, *build_draft_vocab(torch.ones(cfg.vocab_size), 512))
    drafter.save_pretrained(out, include_embedding=False)
    return out


def _copy(good: Path, dst: Path, damage=None, checksum: bool = True) -> Path:
    shutil.copytree(good, dst)
    if damage is not None:
        weights = dst / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
    if not checksum:
        (dst / CHECKSUM).unlink()
    return dst


def _nan_drafter(good: Path, dst: Path, target) -> Path:
    """Saved whole by save_pretrained (its checksum matches): only the finiteness check can refuse it."""
    drafter = Eagle3Drafter.from_pretrained(good, target.model)
    with torch.no_grad():
        drafter.fc.weight[3, 5] = float("nan")
    drafter.save_pretrained(dst, include_embedding=False)
    return dst


DAMAGES = {"truncated": (_truncate, r"bytes, checksum\.json recorded .* \(truncated or replaced since\)"),
           "empty": (_empty, r": 0 bytes, checksum\.json recorded"),
           "bad-header": (_bad_header, r"sha256 .* differs from the .* checksum\.json recorded"),
           "flipped-byte": (_flip, r"sha256 .* differs from the .* checksum\.json recorded"),
           "nan": (None, r"non-finite weights \(NaN or inf\) in fc\.weight \(1 of 995,328 values\)")}


@pytest.fixture(scope="module")
def damaged(good, target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("damaged")
    made = {name: _copy(good, root / name, damage) for name, (damage, _) in DAMAGES.items() if damage is not None}
    made["nan"] = _nan_drafter(good, root / "nan", target)
    return made


def test_save_writes_the_checksum_of_the_weights_and_a_whole_drafter_loads(good, target):
    record = json.loads((good / CHECKSUM).read_text())
    weights = good / "model.safetensors"
    assert record == {"file": "model.safetensors", "sha256": sha256_file(weights), "bytes": weights.stat().st_size}
    assert verify_checksum(good)
    drafter = Eagle3Drafter.from_pretrained(good, target.model)
    assert torch.equal(drafter.fc.weight, load_weights(good)["fc.weight"])


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run `hstap ARGV` in this process: it must exit 2 with exactly one line on stderr (no traceback), said once
    (serve echoed its engine's crash, then the same lines again in its report)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("hstap: error: ") and "\n" not in err and "Traceback" not in err, err
    assert "model.safetensors" not in captured.out, captured.out
    return err


def _command(name: str, drafter: Path, tmp: Path, small_store: Path) -> list[str]:
    return {"eval": ["eval", "--drafter", str(drafter), "--limit", "1", "--max-new-tokens", "8", "--chain", "2",
                     "--out", str(tmp / "ev")],
            "serve": ["serve", "--engine", "hf", "--model", "smollm2", "--drafter", str(drafter), "--run-dir",
                      str(tmp / "serve"), "--port", "8977"],
            "export": ["export", "--drafter", str(drafter), "--format", "sglang", "--out", str(tmp / "export")],
            "train": ["train", "--store", str(small_store), "--out", str(tmp / "run"), "--init-from", str(drafter),
                      "--max-steps", "1", "--calib-prompts", "0"]}[name]


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("command", ["eval", "serve", "export", "train"])
def test_a_damaged_drafter_is_one_line_naming_its_file_in_every_command(damaged, small_store, target, tmp_path,
                                                                        monkeypatch, capsys, command, damage):
    monkeypatch.setattr("hstap.models.load_target", lambda *a, **k: target)  # loaded once for the whole table
    err = _one_line_error(capsys, _command(command, damaged[damage], tmp_path, small_store))
    assert f"{damaged[damage]}/model.safetensors: " in err
    assert re.search(DAMAGES[damage][1], err), err
    # nothing was started or written: no engine log, no export, no run directory left to refuse the next command
    assert not any((tmp_path / name).exists() for name in ("export", "run", "ev")), list(tmp_path.iterdir())
    assert not (tmp_path / "serve" / "engine.log").exists()


@pytest.mark.parametrize("damage, needle", [
    (_truncate, r"not readable as safetensors \(.*incomplete metadata"),
    (_empty, r"empty \(0 bytes\), expected a drafter's safetensors weights"),
    (_bad_header, r"not readable as safetensors \(.*header"),
])
def test_a_drafter_saved_before_checksums_still_has_its_header_checked(good, tmp_path, damage, needle):
    """No checksum.json (a drafter written before 2026-12): it loads, and a damaged file is still one line from
    the safetensors header (a flipped byte inside a weight is what only the checksum finds)."""
    legacy = _copy(good, tmp_path / "legacy", checksum=False)
    assert not verify_checksum(legacy) and load_weights(legacy).keys() == load_weights(good).keys()
    broken = _copy(good, tmp_path / "broken", damage, checksum=False)
    with pytest.raises(HstapError, match=needle) as err:
        load_weights(broken)
    assert str(err.value).startswith(f"{broken}/model.safetensors: ") and "\n" not in str(err.value)


def test_a_drafter_saved_before_checksums_is_still_refused_for_a_nan(damaged, tmp_path):
    legacy = _copy(damaged["nan"], tmp_path / "legacy", checksum=False)
    with pytest.raises(HstapError, match=r"model\.safetensors: non-finite weights .* in fc\.weight"):
        load_weights(legacy)


def test_a_checksum_file_that_is_not_one_is_named(good, tmp_path):
    broken = _copy(good, tmp_path / "d")
    (broken / CHECKSUM).write_text("{not json")
    with pytest.raises(HstapError, match=r"checksum\.json: not a checksum record .*delete it to load the drafter "):
        load_weights(broken)
