"""Issue 43's probe of bad inputs, as a table: each row is one bad input through the real CLI (`hstap.cli.main`,
in-process), which must end with the right exit code and exactly one stderr line starting `hstap`, naming the file
or field — never a traceback — and must not have done the work first (no model loads for any row). Then the silent
cases: records a command dropped without a word, a server that never answers, results lost to a late write.

Rows marked `(#N)` are the numbered tracebacks of issue 43 (the half about outputs, stores, configs and serving);
the others are its silent or accepted-then-failed cases. `ro/` is a directory this process cannot write into (a
read-only tmpfs as root, chmod 555 otherwise: tests/conftest.py `read_only_dir`).

    .venv/bin/python -m pytest -q -n 0 tests/test_bad_inputs.py
"""

from __future__ import annotations

import json
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import torch

from hstap.cli import main
from hstap.store import StoreMeta, StoreWriter

GOOD = {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"},
                                {"role": "assistant", "content": "Paris."}]}
BAD_RECORDS = [{"id": "b", "messages": [{"role": "user", "content": "   "}]},  # empty_turn
               {"id": "c", "messages": [{"role": "wizard", "content": "hi"}]}]  # bad_role


def _store(path: Path, hidden: int, fingerprint: str, model_id: str) -> Path:
    """A one-sample store of a model with hidden size `hidden` (a capture of SmolLM2 has 576)."""
    meta = StoreMeta(model_id=model_id, model_fingerprint=fingerprint, layer_ids=[1, 14, 26], hidden_size=hidden,
                     hidden_dtype="bf16", teacher="hidden")
    with StoreWriter(path, meta) as w:
        w.add("s0", {"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.bool),
                     "teacher.hidden": torch.zeros(4, hidden, dtype=torch.bfloat16),
                     **{f"hidden.{k}": torch.zeros(4, hidden, dtype=torch.bfloat16) for k in (1, 14, 26)}})
    return path


@pytest.fixture
def paths(tmp_path: Path, read_only_dir: Path) -> dict[str, Path]:
    """Every file a row names: stores of two models, a UTF-16 config, a YAML `limit: true`, JSONL files, a directory
    holding a store and one holding a training run."""
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "binary.yaml").write_bytes("capture:\n  limit: 2\n".encode("utf-16"))  # starts 0xff 0xfe
    (tmp_path / "bool.yaml").write_text("capture:\n  limit: true\n")
    (tmp_path / "bool-switch.yaml").write_text("capture:\n  force: 1\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "model.safetensors", "train_config.json", "metrics.jsonl"):
        (run / name).write_text("{}")
    return {"tmp": tmp_path, "ro": read_only_dir, "run": run, "good": tmp_path / "good.jsonl",
            "smollm2": _store(tmp_path / "smollm2", 576, "f1e5a7", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            "other": _store(tmp_path / "other", 128, "0b7e44", "tiny/other-model")}


CASES = [  # (id, argv with {placeholders}, exit code, what the one line must say)
    ("compare-other-model (#1)", "compare {smollm2} {other}", 2,
     "DIFFERENT STORES: {smollm2} and {other} cannot be compared: model HuggingFaceTB/SmolLM2-135M-Instruct "
     "(fingerprint f1e5a7) vs tiny/other-model (fingerprint 0b7e44); hidden size 576 vs 128"),
    ("synth-out-proc (#2)", "synth --model smollm2 --data jsonl:{good} --limit 2 --max-new-tokens 8 "
                            "--out /proc/hstap.jsonl", 2, "--out /proc/hstap.jsonl: cannot write in /proc (proc, a "
                                                           "kernel filesystem"),
    ("eval-out-ro (#7)", "eval --limit 1 --max-new-tokens 8 --chain 2 --drafter {tmp}/d --out {ro}/ev", 2,
     "--out {ro}/ev: cannot write in {ro} ("),
    ("eval-out-proc (#8)", "eval --limit 1 --max-new-tokens 8 --chain 2 --drafter {tmp}/d --out /proc/x", 2,
     "--out /proc/x: cannot write in /proc (proc"),
    ("config-not-utf8 (#9)", "capture --config {tmp}/binary.yaml --out {tmp}/cap --plan", 2,
     "--config {tmp}/binary.yaml: not UTF-8 (byte 0xff at byte 1)"),
    ("serve-run-dir-ro (#11)", "serve --engine hf --model smollm2 --run-dir {ro}/serve", 2,
     "--run-dir {ro}/serve: cannot write in {ro} ("),
    ("serve-command-missing (#12)", "serve --engine hf --model smollm2 --run-dir {tmp}/serve --command "
                                    "/nonexistent/prog", 2, "--command /nonexistent/prog: no such file"),
    ("prompts-out-proc (#13)", "prompts --out /proc/p.jsonl --total 10 --source sharegpt:1", 2,
     "--out /proc/p.jsonl: cannot write in /proc (proc"),
    ("merge-out-proc (#14)", "store merge {smollm2} {other} --out /proc/m", 2, "--out /proc/m: cannot write in /proc"),
    ("merge-out-ro (#15)", "store merge {smollm2} {other} --out {ro}/m", 2, "--out {ro}/m: cannot write in {ro} ("),
    ("serve-run-dir-proc", "serve --engine hf --model smollm2 --run-dir /proc/serve", 2,
     "--run-dir /proc/serve: cannot write in /proc (proc"),
    ("capture-teacher-k-over-vocab", "capture --data jsonl:{good} --out {tmp}/cap --teacher topk:100000", 2,
     "--teacher topk:100000: k must be at most the vocabulary of --model smollm2 (49,152 tokens)"),
    ("yaml-bool-as-int", "capture --config {tmp}/bool.yaml --out {tmp}/cap --plan", 2,
     "capture.limit (--limit): expected an integer, got the YAML boolean true"),
    ("set-bool-as-int", "capture --set capture.limit=true --out {tmp}/cap --plan", 2,
     "capture.limit (--limit): expected an integer, got the YAML boolean true"),
    ("yaml-int-as-bool", "capture --config {tmp}/bool-switch.yaml --out {tmp}/cap --plan", 2,
     "capture.force (--force): expected true or false, got the YAML number 1"),
    ("export-force-over-store", "export --drafter {tmp}/d --format vllm --out {smollm2} --force", 2,
     "--out {smollm2} holds a capture store (manifest.json, shard-00000.safetensors): --force only replaces an "
     "export"),
    ("export-force-over-run", "export --drafter {tmp}/d --format sglang --out {run} --force", 2,
     "--out {run} holds a training run (train_config.json, metrics.jsonl): --force only replaces an export"),
]


def _run(argv: str, paths: dict[str, Path], capsys) -> tuple[int, str]:
    try:
        code = main(argv.format(**paths).split())
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case, argv, code, needle", CASES, ids=[c[0].split()[0] for c in CASES])
def test_bad_input_is_one_line_naming_it(case, argv, code, needle, paths, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError(f"{case}: a model was loaded before the bad input was refused")

    monkeypatch.setattr("hstap.models.load_target", no_model)
    monkeypatch.setattr("hstap.capture.run.load_target", no_model)
    before = {p.name for p in paths["tmp"].iterdir()}
    got, err = _run(argv, paths, capsys)
    assert got == code, err
    assert err.count("\n") == 1 and err.startswith("hstap") and "Traceback" not in err, err
    assert needle.format(**paths) in err, err
    assert {p.name for p in paths["tmp"].iterdir()} == before, "a refused command left something behind"


def test_numbers_in_yaml_are_typed_and_numbers_as_text_still_parse(paths, capsys):
    """`limit: true` was read as 1; flags stay text (`--limit 5`), and a quoted or plain number in YAML works."""
    tmp = paths["tmp"]
    (tmp / "five.yaml").write_text("capture:\n  limit: 5\n  force: true\n  commit_every: 90s\n")
    for argv in (["--limit", "5"], ["--config", str(tmp / "five.yaml")], ["--set", "capture.limit=5"],
                 ["--set", "capture.limit='5'"]):
        assert main(["capture", "--out", str(tmp / "cap"), "--plan", *argv]) == 0, capsys.readouterr().err
        assert "  limit: 5\n" in capsys.readouterr().out
    assert main(["capture", "--config", str(tmp / "bool.yaml"), "--out", str(tmp / "cap"), "--plan"]) == 2
    assert "expected an integer, got the YAML boolean true" in capsys.readouterr().err


def test_capture_remote_names_a_server_that_accepts_and_never_answers(tmp_path, capsys, monkeypatch):
    """A socket that accepts connections (the kernel's backlog) and never answers: `capture-remote` announced the
    samples, sent them and printed nothing until each request's read timeout, ~300 s by default. Now its probe (GET
    /v1/models, as `synth --server` does) names the server in one line, within PROBE_S (30 s; 2 s here) by default
    and within --timeout when that is shorter, before anything is announced."""
    import hstap.capture.remote as remote

    monkeypatch.setattr(remote, "PROBE_S", 2.0)
    (tmp_path / "d.jsonl").write_text(json.dumps(GOOD) + "\n")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete, nothing is ever read or written
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for flags, bound in (([], 2), (["--timeout", "1"], 1)):
            start = time.monotonic()
            code = main(["capture-remote", "--url", url, "--data", f"jsonl:{tmp_path / 'd.jsonl'}", "--capture-dir",
                         str(tmp_path / "cap"), *flags])
            elapsed = time.monotonic() - start
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
            assert err.startswith(f"hstap: error: capture-remote: server {url} accepted the connection but did not "
                                  f"answer GET /v1/models within {bound} s"), err
            assert elapsed < bound + 20, f"took {elapsed:.0f} s, bound {bound} s"
    assert not (tmp_path / "cap" / "requests.jsonl").exists(), "nothing is announced to a server that does not answer"


class _Answering(BaseHTTPRequestHandler):
    """Any GET or POST: 200 and an empty JSON object (the server is up; the store is already complete)."""

    def _ok(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _ok

    def log_message(self, *args) -> None:
        return None


def test_capture_remote_counts_the_records_it_drops(tmp_path, tokenizer, capsys):
    """`capture-remote --data jsonl:F` said "sent N samples" and nothing about the malformed records it dropped.
    Now it says how many, why, and the first one's file and line."""
    from hstap.data import SkipReport, render_all

    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [GOOD, *BAD_RECORDS]))
    sample = render_all(f"jsonl:{data}", tokenizer, SkipReport(), max_tokens=2048)[0]
    meta = StoreMeta(model_id="smollm2", model_fingerprint="x", layer_ids=[1], hidden_size=4, hidden_dtype="bf16",
                     teacher="hidden")
    with StoreWriter(tmp_path / "cap", meta) as w:  # the engine already stored the one good record
        n = len(sample.input_ids)
        w.add(sample.id, {"input_ids": torch.tensor(sample.input_ids), "loss_mask": torch.tensor(sample.loss_mask),
                          "hidden.1": torch.zeros(n, 4, dtype=torch.bfloat16),
                          "teacher.hidden": torch.zeros(n, 4, dtype=torch.bfloat16)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(["capture-remote", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--data",
                     f"jsonl:{data}", "--capture-dir", str(tmp_path / "cap")])
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "sent 0 samples (1 already in the store)" in out
    assert f"skipped 2 records (bad_role=1, empty_turn=1; first: {data}:2: empty_turn)" in out, out


def test_eval_counts_dropped_records_and_keeps_results_a_late_write_loses(target, tmp_path, capsys, monkeypatch):
    """`eval --bench jsonl:F` dropped malformed records without a word, and `eval --out ro/ev` lost every result to
    a PermissionError after the whole evaluation. The skip is said before the run; a report directory that turns
    unwritable during the run (simulated: the write fails as on a read-only mount) costs no result: they are saved
    in a temporary directory and the one line says where."""
    import errno

    import hstap.evaluate.run as run

    monkeypatch.setattr("hstap.models.load_target", lambda *args, **kwargs: target)
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in [*BAD_RECORDS, GOOD]))
    out = tmp_path / "ev"
    write_report = run.write_report

    def read_only_after_the_run(report: dict, out_dir: Path) -> list[Path]:
        if Path(out_dir) == out:
            raise OSError(errno.EROFS, "Read-only file system", str(out / "report.json"))
        return write_report(report, out_dir)

    monkeypatch.setattr(run, "write_report", read_only_after_the_run)
    code = main(["eval", "--bench", f"jsonl:{bench}", "--limit", "1", "--max-new-tokens", "4", "--ngram", "2",
                 "--warmup", "0", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("hstap")]
    assert code == 2 and "Traceback" not in captured.err, captured.err
    assert lines[0] == (f"hstap eval: --bench jsonl:{bench}: skipped 2 records (bad_role=1, empty_turn=1; first: "
                        f"{bench}:1: empty_turn)")
    assert len(lines) == 2 and lines[1].startswith(f"hstap: error: {out}: cannot write the report (Read-only file "
                                                   "system); the results were saved in "), captured.err
    saved = Path(lines[1].split("saved in ")[1].split(" instead")[0])
    report = json.loads((saved / "report.json").read_text())
    assert report["prompts"] == 1 and report["per_prompt"][0]["id"] == "a" and (saved / "report.md").exists()

