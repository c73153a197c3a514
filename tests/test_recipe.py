"""`hstap recipe` (and `hstap demo`, the recipe on SmolLM2) on the real SmolLM2 and ShareGPT, plus its parts.

One real run of the smoke recipe serves every end-to-end test: `hstap recipe --config smollm2-smoke.yaml` killed in
synth (HSTAP_FAULT), then `hstap demo --preset smoke`, the same recipe, finishing it. The rest needs no model.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hstap.cli import main
from hstap.errors import HstapError
from hstap.recipe.config import SHIPPED, STAGES, load_recipe
from hstap.recipe.memory import GIB, choose_training, dense_parameters, online_bytes, safetensors_parameters
from hstap.recipe.state import Action, decide
from hstap.serve.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SMOKE = SHIPPED / "smollm2-smoke.yaml"
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False}


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The smoke recipe killed after synth's third answer (prompts finished), then finished by `hstap demo`:
    (out dir, the demo's console output)."""
    out = tmp_path_factory.mktemp("recipe")
    env = {**os.environ, "HSTAP_FAULT": "record-written:9"}  # prompts writes 6 records, then synth's 3rd
    killed = subprocess.run([sys.executable, "-m", "hstap.cli", "recipe", "--config", str(SMOKE), "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    state = json.loads((out / "recipe.json").read_text())["stages"]
    assert state["prompts"]["finished"] and not state["synth"]["finished"], state
    assert len((out / "synth.jsonl").read_text().splitlines()) == 3
    code, printed, err = _main(["demo", "--preset", "smoke", "--out", str(out)])
    assert code == 0, err
    return out, printed


def test_killed_recipe_resumes_without_redoing_finished_stages(smoke_run):
    out, printed = smoke_run
    assert "── prompts: finished earlier with the same settings: skipped" in printed  # the demo is the same recipe
    assert "synth: continues the interrupted run" in printed
    assert "3 conversations to generate (3 already in" in printed
    for stage in ("synth", "capture", "train", "eval", "export"):
        assert f"── {stage} ──" in printed
    assert len((out / "synth.jsonl").read_text().splitlines()) == 6
    state = json.loads((out / "recipe.json").read_text())["stages"]
    assert all(state[stage]["finished"] for stage in STAGES)


def test_demo_prints_every_stage_and_its_table(smoke_run):
    out, printed = smoke_run
    assert "τ, " in printed and "speedup" in printed
    # the GPU recipe's shipped drafter beside the demo's, with this machine's break-even τ
    assert "the shipped drafter 'reference' (the GPU recipe's) on the same questions" in printed
    assert "break-even" in printed
    assert (out / "eval-shipped" / "report.md").exists()
    assert (out / "eval" / "report.md").exists()
    assert (out / "drafter" / "model.safetensors").exists()
    assert (out / "export-sglang" / "config.json").exists()


def test_a_finished_recipe_skips_everything(smoke_run):
    out, _ = smoke_run
    code, printed, err = _main(["recipe", "--config", str(SMOKE), "--out", str(out), "--stages", "synth,capture"])
    assert code == 0, err
    assert "── synth: finished earlier with the same settings: skipped" in printed
    assert "── capture: finished earlier with the same settings: skipped" in printed
    assert "conversations to generate" not in printed and "── prompts" not in printed


def test_a_changed_finished_stage_is_refused_in_one_line(smoke_run):
    out, _ = smoke_run
    code, _, err = _main(["recipe", "--config", str(SMOKE), "--out", str(out), "--set", "synth.max_new_tokens=20"])
    assert code == 2 and err.count("\n") == 1, err
    assert "synth finished earlier with other settings (synth.max_new_tokens 16 → 20): pass --redo synth" in err
    # a stage downstream names the stage whose settings changed
    code, _, err = _main(["recipe", "--config", str(SMOKE), "--out", str(out), "--set", "synth.max_new_tokens=20",
                          "--stages", "eval"])
    assert code == 2 and "eval finished earlier with other settings (it read the output of synth" in err, err
    # a field that changes how a stage runs, not what it makes, is no change; --redo redoes what reads its output
    code, plan, err = _main(["recipe", "--config", str(SMOKE), "--out", str(out), "--set", "synth.batch_size=2",
                             "--set", "train.lr=1e-3", "--redo", "train", "--plan"])
    assert code == 0, err
    assert "# synth: skip" in plan and "# train: redo" in plan and "# eval: redo" in plan


def test_online_training_skips_the_store_and_stages_pick_a_subset(smoke_run, tmp_path):
    """The gpu preset's path (online training under a time budget), at the smoke sizes on the CPU, from the smoke
    run's prompts and answers."""
    for name in ("prompts.jsonl", "synth.jsonl"):
        shutil.copy(smoke_run[0] / name, tmp_path / name)
    code, printed, err = _main(["recipe", "--config", str(SMOKE), "--out", str(tmp_path), "--training", "online",
                                "--set", "train.time_budget_s=600", "--stages", "capture,train"])
    assert code == 0, err
    assert "training: online (set in the recipe)" in printed
    assert "── capture: online training — the target runs inside training, nothing is stored: skipped" in printed
    assert "── train ──" in printed and "── eval" not in printed and "── synth" not in printed
    assert not (tmp_path / "store").exists()
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    assert '"kind": "budget"' in (tmp_path / "drafter" / "metrics.jsonl").read_text()


FAKE_ENGINE = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})
    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["content-length"])))["messages"][-1]["content"]
        self._send({"model": "fake", "choices": [{"message": {"content": "echo: " + asked}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    def log_message(self, *args):
        pass
print("Application startup complete.", flush=True)  # vLLM's ready line
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_synth_through_an_engine_the_recipe_starts_and_stops(tmp_path):
    """`serve:` starts the engine through hstap serve's supervisor (here a stand-in answering as vLLM does), synth
    answers through it, and the engine is stopped before the next stage."""
    port = free_port()
    (tmp_path / "fake.py").write_text(FAKE_ENGINE)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user",
                                                          "content": f"question {i}"}]}) + "\n" for i in range(3)))
    (tmp_path / "r.yaml").write_text(json.dumps({
        "recipe": {"out": str(tmp_path / "out"), "stages": ["prompts", "synth"]},
        "serve": {"engine": "vllm", "port": port, "command": [sys.executable, str(tmp_path / "fake.py")],
                  "stall_timeout": 60},
        "synth": {"data": f"jsonl:{tmp_path / 'p.jsonl'}"}}))
    code, printed, err = _main(["recipe", "--config", str(tmp_path / "r.yaml")])
    assert code == 0, printed + err
    assert "── prompts: synth reads jsonl:" in printed  # prompts nobody reads are not made
    assert "ready on http://127.0.0.1:" in printed and "stopping the engine (stopped)" in printed
    records = [json.loads(line) for line in (tmp_path / "out" / "synth.jsonl").read_text().splitlines()]
    assert sorted(r["messages"][-1]["content"] for r in records) == [f"echo: question {i}" for i in range(3)]
    assert {r["model"] for r in records} == {"fake"}


@pytest.mark.parametrize("text,expected", [
    ("recipe: {out: OUT}\ntrian: {lr: 1.0}\n", "unknown section 'trian'; valid sections: recipe, prompts"),
    ("recipe: {out: OUT}\ntrain: {lrr: 1.0}\n", "train.lrr: unknown field; valid: store,"),
    ("recipe: {outt: OUT}\n", "recipe.outt: unknown field; valid: model, device, out"),
    ("recipe: {out: OUT}\nsynth: {max_new_tokens: 0}\n", "synth.max_new_tokens: Input should be greater than"),
    ("recipe: {out: OUT}\ntrain: {online: true}\n", "train.online: set by the recipe's training mode"),
    ("- a list\n", "expected a mapping of sections"),
])
def test_a_bad_recipe_file_is_one_line_naming_the_file_and_field(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("OUT", str(tmp_path / "out")))
    code, _, err = _main(["recipe", "--config", str(path), "--plan"])
    assert code == 2 and err.count("\n") == 1, err
    assert f"--config {path}: " in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_set_and_redo_errors_name_what_was_given(tmp_path):
    code, _, err = _main(["recipe", "--config", "smollm2-smoke", "--out", str(tmp_path), "--set", "eval.limitt=2"])
    assert code == 2 and "--set eval.limitt: unknown field" in err
    code, _, err = _main(["recipe", "--config", "smollm2-smoke", "--stages", "eval", "--redo", "train"])
    assert code == 2 and "--redo train: not among the stages that run (eval)" in err
    code, _, err = _main(["recipe", "--config", "no-such-recipe"])
    assert code == 2 and "shipped: " in err and "smollm2-gpu" in err


def test_every_shipped_recipe_validates_and_the_gpu_preset_trains_online_under_a_budget():
    for path in sorted(SHIPPED.glob("*.yaml")):
        load_recipe(path)  # every section checked by its stage's config
    gpu = load_recipe("smollm2-gpu")
    assert gpu.settings.device == "cuda" and gpu.settings.training == "online"
    assert gpu.sections["train"]["time_budget_s"] == "420s"


def test_the_plan_is_itself_a_recipe_file(tmp_path):
    code, plan, err = _main(["recipe", "--config", "smollm2-cpu", "--out", str(tmp_path / "r"), "--plan"])
    assert code == 0, err
    assert "# training: store (auto: on the CPU" in plan and "# capture: run" in plan
    (tmp_path / "plan.yaml").write_text(plan)
    code, again, err = _main(["recipe", "--config", str(tmp_path / "plan.yaml"), "--plan"])
    assert code == 0 and again == plan, err


def test_docs_show_the_shipped_8b_recipe_word_for_word():
    doc = (ROOT / "docs" / "recipe.md").read_text()
    assert (SHIPPED / "llama-3.1-8b-sglang.yaml").read_text() in doc


def test_online_or_store_without_a_gpu():
    """The decision (hstap.recipe.memory): what the recipe sets, store on a CPU, online where the estimate fits."""
    assert choose_training("online", "cpu").mode == "online"
    assert choose_training("auto", "cpu").mode == "store"
    assert dense_parameters(LLAMA_8B) == 8_030_261_248  # Llama-3.1-8B's published count
    need = online_bytes(LLAMA_8B, 8_030_261_248, draft_vocab=32000, ttt_steps=7, batch_tokens=16384)
    assert 45 * GIB < need < 65 * GIB
    fits = choose_training("auto", "cuda", need, free_bytes=79 * GIB)  # an idle H100
    assert fits.mode == "online" and "GiB needed" in fits.reason
    assert choose_training("auto", "cuda", need, free_bytes=79 * GIB - 30 * GIB).mode == "store"  # an engine beside it
    llama_70b = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                 "intermediate_size": 28672}
    big = online_bytes(llama_70b, dense_parameters(llama_70b), 32000, 7, 16384)
    assert choose_training("auto", "cuda", big, free_bytes=139 * GIB).mode == "store"  # not even on an H200


def test_auto_on_cuda_reads_the_target_and_the_free_memory(monkeypatch, tmp_path):
    """The CUDA branch without a GPU: SmolLM2's parameters from its safetensors, the drafter at the train section's
    sizes, the device's free memory (faked): online when it fits, store when an engine holds the memory."""
    import hstap.preflight
    import hstap.recipe.memory

    monkeypatch.setattr(hstap.preflight, "check_device", lambda device, flag="": None)
    for free, mode in [(79 * GIB, "online"), (GIB, "store")]:
        monkeypatch.setattr(hstap.recipe.memory, "free_memory", lambda device: free)
        code, plan, err = _main(["recipe", "--config", "smollm2-gpu", "--training", "auto", "--out", str(tmp_path),
                                 "--plan"])
        assert code == 0, err
        assert f"# training: {mode} (auto: the target and the drafter in training " in plan, plan[-600:]


def test_parameters_are_read_from_safetensors_headers(tmp_path):
    for i, shapes in enumerate([{"a": [3, 4], "b": [5]}, {"c": [2, 2, 2]}]):
        header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
                             for name, shape in shapes.items()} | {"__metadata__": {"format": "pt"}}).encode()
        (tmp_path / f"model-{i}.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    assert safetensors_parameters(tmp_path) == 12 + 5 + 8
    assert safetensors_parameters(tmp_path / "none") is None


@pytest.mark.parametrize("record,fp,redo,expected", [
    (None, "f1", False, "run"),
    ({"fingerprint": "f1", "finished": "t"}, "f1", False, "skip"),
    ({"fingerprint": "f1", "finished": None}, "f1", False, "run"),
    ({"fingerprint": "f0", "finished": "t"}, "f1", True, "redo"),
    ({"fingerprint": "f0", "finished": "t"}, "f1", False, "refused"),
    ({"fingerprint": "f0", "finished": None}, "f1", False, "refused"),
])
def test_what_a_stage_does_from_its_record(record, fp, redo, expected):
    try:
        action = decide("synth", record, fp, lambda: ("synth.seed 0 → 1", "synth"), redo, Path("out/recipe.json"))
    except HstapError as exc:
        assert expected == "refused" and "synth.seed 0 → 1" in str(exc) and "--redo synth" in str(exc)
        return
    assert isinstance(action, Action) and action.kind == expected
