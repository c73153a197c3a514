"""Bad flags and environments through the real CLI, command by command: each is a one-line error naming the flag
or file (exit 2), raised before any model loads — never a traceback. Table-driven: every row is one bad input of
issue 13's list (docs/reliability-train.md counts them)."""

from __future__ import annotations

import json

import pytest
import torch

from hstap.cli import main
from hstap.preflight import check_out_dir, check_out_file

NO_GPU = not torch.cuda.is_available()


def _jsonl(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.fixture
def paths(tmp_path):
    """A file where a directory belongs, a directory named like a .jsonl file, bad JSONL inputs."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dir.jsonl").mkdir()
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return {
        "file": tmp_path / "a-file",
        "dir_jsonl": tmp_path / "dir.jsonl",
        "not_json": _jsonl(tmp_path / "not-json.jsonl", [good, b'{"id": "b", "messages": [']),
        "not_utf8": _jsonl(tmp_path / "latin1.jsonl", [good, '{"id": "c", "messages": [{"role": "user", "content": '
                                                              '"caf\xe9"}]}'.encode("latin-1")]),
        "no_messages": _jsonl(tmp_path / "no-messages.jsonl", [b'{"id": "d"}']),
        "all_bad": _jsonl(tmp_path / "all-bad.jsonl", [
            b'{"id": "e", "messages": []}',
            b'{"id": "f", "messages": [{"role": "user", "content": "   "}]}',
            b'{"id": "g", "messages": [{"role": "wizard", "content": "hi"}]}',
            b'{"id": "h", "messages": [{"role": "assistant", "content": "hi"}]}']),
        "tmp": tmp_path,
    }


CASES = [  # (id, argv with {placeholders}, what the one line must say)
    ("train-device-banana", "train --store {tmp}/s --out {tmp}/o --device banana",
     "train.device (--device): expected cpu, cuda or cuda:N, got 'banana'"),
    ("synth-device-banana", "synth --model smollm2 --out {tmp}/o.jsonl --device banana",
     "synth.device (--device): expected cpu, cuda or cuda:N"),
    ("capture-device-banana", "capture --out {tmp}/o --device banana", "capture.device (--device): expected cpu"),
    ("train-out-file", "train --store {tmp}/s --out {file}", "--out {file}: is a file, expected a directory"),
    ("capture-out-file", "capture --out {file} --limit 1", "--out {file}: is a file, expected a directory"),
    ("capture-out-under-file", "capture --out {file}/sub --limit 1", "{file} is a file, so the directory cannot"),
    ("synth-out-dir", "synth --model smollm2 --out {dir_jsonl}", "--out {dir_jsonl}: is a directory"),
    ("train-unknown-flag", "train --store {tmp}/s --out {tmp}/o --bogus",
     "hstap train: error: unrecognized arguments: --bogus (see hstap train --help)"),
    ("synth-unknown-flag", "synth --model smollm2 --out {tmp}/o.jsonl --temprature 0.7",
     "unrecognized arguments: --temprature 0.7"),
    ("capture-unknown-dtype", "capture --out {tmp}/o --dtype int8", "argument --dtype: invalid choice: 'int8'"),
    ("capture-unknown-dtype-set", "capture --out {tmp}/o --set capture.dtype=int8",
     "capture.dtype (--dtype): Input should be 'bf16', 'fp16'"),  # the list grows (fp8)
    ("export-unknown-dtype", "export --drafter {tmp}/d --format vllm --out {tmp}/e --dtype float8",
     "invalid choice: 'float8'"),
    ("train-missing-model", "train --store {tmp}/s --out {tmp}/o --model {tmp}/no-model",
     "--model '{tmp}/no-model': expected one of [smollm2] or a transformers checkpoint directory"),
    ("capture-missing-model", "capture --out {tmp}/o --model {tmp}/no-model", "expected one of [smollm2]"),
    ("train-layers-duplicate", "train --online --out {tmp}/o --layers 1,1,5", "--layers [1, 1, 5]: duplicate ids"),
    ("train-layers-unsorted", "train --online --out {tmp}/o --layers 14,1,26", "ids must be ascending"),
    ("train-layers-range", "train --online --out {tmp}/o --layers 1,14,30", "ids [30] out of range"),
    ("train-layers-text", "train --online --out {tmp}/o --layers 1,x", "expected 'auto' or comma-separated"),
    ("train-store-and-online", "train --online --store {tmp}/s --out {tmp}/o", "either --store DIR (offline) or"),
    ("train-store-loops-cut", "train --store {tmp}/s --out {tmp}/o --loops cut",
     "--loops cut is for --online; a store keeps what its capture rendered (hstap capture --loops cut)"),
    ("capture-unknown-loops", "capture --out {tmp}/o --loops drop", "argument --loops: invalid choice: 'drop'"),
    ("train-resume-no-checkpoint", "train --store {tmp}/s --out {tmp} --resume", "--resume: no checkpoint in"),
    ("train-resume-and-overwrite", "train --store {tmp}/s --out {tmp}/o --resume --overwrite", "pass one of them"),
    ("train-out-not-empty", "train --store {tmp}/s --out {tmp}", "is not empty (a-file, all-bad.jsonl, dir.jsonl"),
    ("train-overwrite-not-a-run", "train --store {tmp}/s --out {tmp} --overwrite",
     "--overwrite: --out {tmp} holds no training run (a-file, all-bad.jsonl"),
    ("export-store-without-check", "export --drafter {tmp}/d --format vllm --out {tmp}/e --store {tmp}/s",
     "--store goes with --check"),
    ("export-no-format", "export --drafter {tmp}/d --out {tmp}/e", "--format sglang|vllm is required"),
    ("synth-missing-jsonl", "synth --model smollm2 --data jsonl:{tmp}/none.jsonl --out {tmp}/o.jsonl",
     "{tmp}/none.jsonl: file not found"),
    ("synth-not-json", "synth --model smollm2 --data jsonl:{not_json} --out {tmp}/o.jsonl",
     "{not_json}:2: not valid JSON"),
    ("synth-not-utf8", "synth --model smollm2 --data jsonl:{not_utf8} --out {tmp}/o.jsonl",
     "{not_utf8}:2: not UTF-8 (byte 0xe9"),
    ("synth-no-messages", "synth --model smollm2 --data jsonl:{no_messages} --out {tmp}/o.jsonl",
     "{no_messages}:1: field 'messages' must be a list"),
    ("synth-only-bad-records", "synth --model smollm2 --data jsonl:{all_bad} --out {tmp}/o.jsonl",
     "no usable conversations (skipped 4 (bad_role=1, empty_conversation=1, empty_turn=1, first_not_user=1))"),
    ("synth-missing-model", "synth --model {tmp}/no-model --data jsonl:{no_messages}.ok --out {tmp}/o.jsonl",
     "expected one of [smollm2]"),
]
GPU_CASES = [
    ("train-device-cuda", "train --store {tmp}/s --out {tmp}/o --device cuda", "--device cuda: "),
    ("synth-device-cuda", "synth --model smollm2 --out {tmp}/o.jsonl --device cuda:1", "--device cuda:1: "),
    ("capture-device-cuda", "capture --out {tmp}/o --device cuda --limit 1", "--device cuda: "),
]


def _run(argv: str, paths, capsys) -> tuple[int, str]:
    code = main(argv.format(**paths).split())
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case, argv, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_it(case, argv, needle, paths, capsys):
    if case == "synth-missing-model":  # a valid source, so the run gets as far as the model
        (paths["tmp"] / "no-messages.jsonl.ok").write_text(
            json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    try:
        code, err = _run(argv, paths, capsys)
    except SystemExit as exc:  # argparse: unknown flags and choices
        code, err = exc.code, capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert needle.format(**paths) in err, err


@pytest.mark.skipif(not NO_GPU, reason="the machine has a GPU")
@pytest.mark.parametrize("case, argv, needle", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_without_a_gpu_is_one_line_before_anything_loads(case, argv, needle, paths, capsys):
    code, err = _run(argv, paths, capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err and "use --device cpu" in err, err


@pytest.mark.parametrize("command", ["train", "capture", "synth", "export"])
def test_read_only_out_is_one_line(command, read_only_dir, paths, capsys):
    argv = {"train": f"train --store {paths['tmp']}/s --out {read_only_dir}/run",
            "capture": f"capture --out {read_only_dir}/store --limit 1",
            "synth": f"synth --model smollm2 --out {read_only_dir}/o.jsonl",
            "export": f"export --drafter {paths['tmp']}/d --format sglang --out {read_only_dir}/e"}[command]
    code, err = _run(argv, paths, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"cannot write in {read_only_dir} (" in err and "choose a writable directory" in err, err


def test_out_checks_accept_what_a_run_can_create(tmp_path):
    check_out_dir(tmp_path / "new" / "deeper")  # created later by the run
    check_out_dir(tmp_path)
    check_out_file(tmp_path / "new" / "o.jsonl")
    (tmp_path / "o.jsonl").write_text("")
    check_out_file(tmp_path / "o.jsonl")
    assert not (tmp_path / "new").exists(), "a check creates nothing"
