"""SGLang 0.5.20 beside 0.5.23: what hstap emits for each release, checked against that release's own sources and
parser, and hooks that refuse a release they were not made for.

0.5.23's sources are hstap's environment's (`make test` installs the wheel --no-deps); 0.5.20's are the live
engine's, `.venv-sglang` (engines/sglang.sh; `HSTAP_SGLANG_PYTHON` points elsewhere). Missing, these tests fail.
In 0.5.20 every decoder layer returns `(hidden, residual)` (DeepSeek's `(hidden, residual, topk_indices)`), so the
hooks sit on the layers; in 0.5.23 Llama's return one tensor, so they sit on the next input norms.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstap.capture.arch import SGLANG, sglang_row
from hstap.capture.engine_session import REQUESTS_NAME, close_sessions
from hstap.cli import main
from hstap.store.compare import compare_stores
from tests.capture.conftest import LAYERS
from tests.capture.engine_model import SgCausalLM, extend_batch
from tests.capture.engine_sources import EngineSource
from tests.capture.test_arch import _row_facts, derive
from tests.live.conftest import engine_python

pytest.importorskip("sglang.srt.model_executor.hook_manager")
from sglang.srt.model_executor.hook_manager import register_forward_hooks  # noqa: E402

pytestmark = pytest.mark.engine

# Parses a launch line with the installed release's own CLI parser and prints what capture depends on.
PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
a = p.parse_args(json.load(sys.stdin))
print(json.dumps({"hooks": a.forward_hooks, "radix_off": a.disable_radix_cache,
                  "prefill_graphs": a.cuda_graph_backend_prefill,
                  "fusion_off": a.enforce_disable_flashinfer_allreduce_fusion}))
"""


def _run(python: Path, code: str, stdin: str = "") -> str:
    done = subprocess.run([str(python), "-c", code], input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def sglang20() -> Path:
    """The Python of the 0.5.20 engine environment (checked to be 0.5.20)."""
    python = engine_python("sglang")
    version = _run(python, "import importlib.metadata as m; print(m.version('sglang'))").strip()
    assert version == "0.5.20", f"{python} has sglang {version}: engines/sglang.txt pins 0.5.20"
    return python


@pytest.fixture(scope="module")
def src20(sglang20) -> EngineSource:
    where = _run(sglang20, "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])")
    return EngineSource(Path(where.strip()) / "srt" / "models", "sglang.srt.models")


@pytest.mark.parametrize("arch", sorted(SGLANG))
def test_0_5_20_rows_match_0_5_20_sources(src20, arch):
    """Every row as 0.5.20 builds it (same module names, `pairs` layers), derived again from 0.5.20's model files."""
    row = sglang_row(SGLANG[arch], "0.5.20")
    assert derive(src20, arch, row, "sglang") == _row_facts(row)


def test_the_0_5_23_rows_do_not_hold_for_0_5_20(src20):
    """The check tells the releases apart: Llama's 0.5.23 row (`stream`) is wrong against 0.5.20's sources."""
    assert derive(src20, "LlamaForCausalLM", SGLANG["LlamaForCausalLM"], "sglang")["output"] == "pairs"
    assert derive(src20, "DeepseekV3ForCausalLM", SGLANG["DeepseekV3ForCausalLM"], "sglang")["output"] == "pairs"


def _plan(python: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The launch arguments `hstap serve --plan` builds for the engine in `python`'s environment."""
    done = subprocess.run([sys.executable, "-m", "hstap.cli", "serve", "--engine", "sglang", "--engine-python",
                           str(python), "--model", "smollm2", "--capture-dir", str(tmp_path / "cap"), "--plan", "--",
                           *extra], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    line = done.stdout.split("# engine command:\n# ", 1)[1].splitlines()[0]
    argv = shlex.split(line)
    return argv[argv.index("sglang.launch_server") + 1:]


def test_serve_emits_what_each_release_parses(sglang20, tmp_path):
    """`hstap serve` asks the engine's Python for its release: the 0.5.20 engine gets hooks on the layers, hstap's
    own 0.5.23 sources hooks on the norms; each launch line parses with that release's own parser."""
    for python, version, first_sites in [(sglang20, "0.5.20", ["model.layers.1", "model.layers.14"]),
                                         (Path(sys.executable), "0.5.23",
                                          ["model.layers.1", "model.layers.2.input_layernorm"])]:
        parsed = json.loads(_run(python, PARSE, json.dumps(_plan(python, tmp_path))))
        assert parsed["radix_off"] and parsed["prefill_graphs"] == "disabled" and parsed["fusion_off"], parsed
        hooks = parsed["hooks"]
        assert [s["target_modules"][0] for s in hooks[:2]] == first_sites, (version, hooks)
        assert {s["config"]["engine_version"] for s in hooks} == {version}


def test_dp_attention_flag_refused_only_where_a_replacement_exists(sglang20, tmp_path):
    """0.5.20 has no --attn-dp-size: --enable-dp-attention is its only DP-attention switch and passes; 0.5.23
    deprecates it for --attn-dp-size, and capture refuses it there."""
    assert _plan(sglang20, tmp_path, "--enable-dp-attention", "--dp-size", "2")[-3:] == [
        "--enable-dp-attention", "--dp-size", "2"]
    with pytest.raises(AssertionError, match="use --attn-dp-size"):
        _plan(Path(sys.executable), tmp_path, "--enable-dp-attention")


def _hooked(capsys, out: Path, samples, contract: str, target, version: str | None, monkeypatch, running: str):
    """SmolLM2 with `contract` layers, hooked through SGLang's register_forward_hooks with the flags
    `hstap sglang-flags [--sglang-version V]` prints, inside an engine that reports release `running`."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    import hstap.capture.sglang as adapter

    monkeypatch.setattr(adapter, "running_sglang", lambda: running)
    capsys.readouterr()
    args = ["sglang-flags", "--model", "smollm2", "--layers", LAYERS, "--out", str(out), "--dtype", "fp32"]
    assert main(args + (["--sglang-version", version] if version else [])) == 0
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = parser.parse_args(["--model-path", "unused", *shlex.split(capsys.readouterr().out)])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / REQUESTS_NAME, "w") as f:
        for s in samples:
            f.write(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
    model = SgCausalLM(target.model, contract)
    register_forward_hooks(model, flags.forward_hooks)
    return model


def test_0_5_20_layers_captured_equal_transformers(target, capsys, tmp_path, convs, samples, monkeypatch):
    """0.5.20's Llama contract (`(hidden, residual)`, the add deferred) with the flags made for 0.5.20, a packed
    batch and a chunked request: equal to the transformers capture."""
    out = tmp_path / "cap"
    model = _hooked(capsys, out, samples, "pairs", target, "0.5.20", monkeypatch, running="0.5.20")
    assert {n for n, m in model.named_modules() if m._forward_hooks} == {
        "model.layers.1", "model.layers.14", "model.layers.29", "model.norm"}
    long = samples[1].input_ids
    model(extend_batch([("a", long[:20], 0), ("b", samples[0].input_ids, 0)]))
    model(extend_batch([("a", long[20:], 20), ("c", samples[2].input_ids, 0)]))
    report = close_sessions()[str(out.resolve())]
    assert report["captured"] == 3 and report["stitched"] == 1 and report["errors"] == 0, report
    cmp = compare_stores(convs[1], out, rtol=1e-5, min_cos=0.99999)
    assert cmp.common == 3 and not cmp.token_mismatch and all(s.max_rel < 1e-5 for s in cmp.tensors.values())


def test_hooks_made_for_another_release_stay_off_and_say_so(target, capsys, tmp_path, samples, monkeypatch):
    """Default flags (0.5.23: norm sites) loaded by a 0.5.20 engine: one `hstap capture: error:` line (which stops
    `hstap serve`), no session, nothing stored; the model's output is untouched."""
    out = tmp_path / "cap"
    model = _hooked(capsys, out, samples, "pairs", target, None, monkeypatch, running="0.5.20")
    err = capsys.readouterr().err
    assert err.count("hstap capture: error:") == 1 and "sglang-flags --sglang-version 0.5.20" in err, err
    plain = SgCausalLM(target.model, "pairs")
    batch = [("a", samples[0].input_ids, 0)]
    assert torch.equal(model(extend_batch(batch)), plain(extend_batch(batch)))
    assert str(out.resolve()) not in close_sessions() and not (out / "manifest.json").exists()


def test_pairs_hooks_on_one_tensor_layers_count_an_error_not_garbage(target, capsys, tmp_path, samples,
                                                                     monkeypatch):
    """Flags for `(hidden, residual)` layers on layers that return one tensor (a wrong row): `output[0] + output[1]`
    would add two token rows and pass for a hidden state; the hook counts an error instead and stores nothing."""
    out = tmp_path / "cap"
    model = _hooked(capsys, out, samples, "stream", target, "0.5.20", monkeypatch, running="0.5.20")
    model(extend_batch([("a", samples[0].input_ids, 0)]))
    report = close_sessions()[str(out.resolve())]
    assert report.get("captured", 0) == 0 and report["errors"] >= 1, report
    assert "returned one tensor" in report["first_error"] and "--sglang-version" in report["first_error"], report
