"""bench/harness.py: the shared flags every benchmark takes, the device check, and the one JSON record."""

from __future__ import annotations

import json
import sys

import pytest

import harness


def test_the_shared_flags_parse_and_the_old_reps_spelling_still_does():
    ap = harness.parser("Doc line.\n\nMore.", device="cpu", repeat=5, warmup=2)
    assert ap.description == "Doc line."
    args = ap.parse_args(["--reps", "3", "--out", "r.json"])
    assert (args.device, args.repeat, args.warmup, str(args.out)) == ("cpu", 3, 2, "r.json")
    assert ap.parse_args(["--repeat", "7"]).repeat == 7
    bare = harness.parser("Doc.", device=None).parse_args([])
    assert not hasattr(bare, "device") and not hasattr(bare, "repeat") and bare.out is None


@pytest.mark.parametrize("name, error", [("tpu", "expected cpu, cuda or cuda:N"), ("cuda:x", "expected cpu, cuda"),
                                         ("cuda:99", "")])
def test_a_device_this_machine_lacks_is_one_line_naming_the_flag(name, error):
    import torch

    if name == "cuda:99":
        error = "only" if torch.cuda.is_available() else "no CUDA device"
    with pytest.raises(SystemExit, match=f"--device .*{error}") as exc:
        harness.check_device(name)
    assert "\n" not in str(exc.value)
    assert harness.check_device("cpu") == "cpu"


def test_the_record_carries_hardware_date_command_settings_and_numbers(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sub" / "result.json"
    monkeypatch.setattr(sys, "argv", ["bench/demo_bench.py", "--device", "cpu", "--out", str(out), "--reps", "4"])
    ap = harness.parser(__doc__, device="cpu", repeat=1)
    ap.add_argument("--path-setting", default=tmp_path)
    run = harness.start(ap.parse_args())
    assert "command: python bench/demo_bench.py --device cpu" in capsys.readouterr().out
    run.finish({"tok_s": {1: 12.5}, "shape": (2, 3)})
    record = json.loads(out.read_text())
    assert record["benchmark"] == "demo_bench" and record["date"][:4].isdigit()
    assert record["command"].startswith("python bench/demo_bench.py") and "--reps 4" in record["command"]
    assert record["hardware"]["device"] == "cpu" and record["hardware"]["cores"] >= 1 and "torch" in record["hardware"]
    assert record["settings"] == {"device": "cpu", "repeat": 4, "path_setting": str(tmp_path)}
    assert record["numbers"] == {"tok_s": {"1": 12.5}, "shape": [2, 3]}
    assert not list(out.parent.glob("*.tmp"))


def test_only_rank_zero_writes_under_torchrun(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setenv("RANK", "1")
    harness.start(harness.parser("D.", device=None).parse_args(["--out", str(out)])).finish({"x": 1})
    assert not out.exists()
