"""Kimi-K2.5 at tp 8 on an H100/H200: SGLang 0.5.23's own argument resolution turns the FlashInfer all-reduce fusion
on by itself, and the flags `hstap sglang-flags` prints turn it off.

The fusion matters because its kernel completes the residual and runs the next layer's input norm in one call,
`plan.norm.forward_with_allreduce_fusion(...)` (srt/layers/layer_boundary/fusions/allreduce.py:109, for batches up to
2,048 tokens, residual/add_norm.py:144-158): the forward hooks hstap puts on `layers.{k+1}.input_layernorm` never run
and the store stays empty. SGLang decides it in `_flashinfer_allreduce_fusion_auto_enable`
(srt/arg_groups/overrides.py:955-1001) from the architecture, the GPU generation and the parallel layout, so only
SGLang's own resolution of a real launch line says whether it is on. sglang_resolve.py runs that resolution in a
subprocess (SGLang's logging and process state stay out of this one), with only the hardware queries answered.
The same resolution shows why `hstap serve` refuses `--cuda-graph-config`: its prefill backend wins over the
`--cuda-graph-backend-prefill disabled` hstap passes, and prefill CUDA graphs replay without running hooks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hstap.cli import main
from hstap.errors import HstapError
from hstap.serve.engines import check_flags, engine_spec
from tests.capture.test_arch import KIMI_K25, SEED_LAYERS

pytest.importorskip("sglang.srt.server_args")

pytestmark = pytest.mark.engine

RESOLVE = Path(__file__).with_name("sglang_resolve.py")
DEPS = Path(sys.prefix) / "sglang-resolve"  # requirements-sglang-resolve.txt, installed by `make install`
GRAPH_JSON = ["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}']


def _resolve(runs: dict[str, list[str]]) -> dict[str, dict]:
    assert DEPS.is_dir(), f"{DEPS} is missing: `make install` puts requirements-sglang-resolve.txt there"
    done = subprocess.run([sys.executable, str(RESOLVE), json.dumps(runs)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(DEPS)})
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    errors = {name: a["error"] for name, a in answers.items() if "error" in a}
    assert not errors, errors
    return answers


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """SGLang's resolution of `launch_server --model-path <Kimi-K2.5 config> --tp-size 8` on an sm90 GPU: alone, with
    hstap's flags, with hstap's flags and a prefill CUDA-graph JSON; and alone on this machine's own platform."""
    root = tmp_path_factory.mktemp("fusion")
    kimi = root / "kimi-k2.5"  # config.json only
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps(KIMI_K25))
    printed = io.StringIO()  # `hstap sglang-flags` prints the flags to paste after the model path
    with contextlib.redirect_stdout(printed):
        assert main(["sglang-flags", "--model", str(kimi), "--layers", SEED_LAYERS, "--out", str(root / "cap")]) == 0
    hstap = shlex.split(printed.getvalue())
    base = ["--model-path", str(kimi), "--tp-size", "8"]
    runs = {"plain": base, "hstap": [*base, *hstap], "plain@cpu": base,
            "hstap+graph-json": [*base, *hstap, *GRAPH_JSON]}
    return {**_resolve(runs), "flags": hstap}


def test_kimi_k25_at_tp8_on_sm90_gets_the_fusion_from_sglang_itself(resolved):
    plain = resolved["plain"]
    assert plain["flashinfer_allreduce_fusion_backend"] == "auto"
    assert plain["lines"] == ["Auto-enabling FlashInfer AllReduce Fusion (auto) for KimiK25ForConditionalGeneration"]
    assert plain["prefill_cuda_graph_backend"] == "breakable"  # and prefill CUDA graphs, CUDA's default
    # the platform answer is what turns it on: the same launch line on this machine's own platform does not
    assert resolved["plain@cpu"]["flashinfer_allreduce_fusion_backend"] is None


def test_hstaps_flags_turn_the_fusion_off(resolved):
    hstap = resolved["hstap"]
    assert hstap["flashinfer_allreduce_fusion_backend"] is None
    assert hstap["prefill_cuda_graph_backend"] == "disabled"
    # SGLang still logs the auto-enable, then the enforce-disable at once: what `hstap serve` reads (test_serve_fusion)
    assert hstap["lines"] == [
        "Auto-enabling FlashInfer AllReduce Fusion (auto) for KimiK25ForConditionalGeneration",
        "FlashInfer allreduce fusion is forcibly disabled via --enforce-disable-flashinfer-allreduce-fusion."]
    # nothing else that skips a hook or slices the residual came on by itself for this launch
    assert hstap["paths"] == {"enable_two_batch_overlap": False, "enable_single_batch_overlap": False,
                              "enable_torch_compile": False, "attn_dp_size": 1, "moe_a2a_backend": "none",
                              "enable_attn_tp_input_scattered": False, "enable_layernorm_sp": False,
                              "enable_aiter_allreduce_fusion": False, "disable_radix_cache": True}
    hooks = json.loads(resolved["flags"][resolved["flags"].index("--forward-hooks") + 1])
    text = "language_model.model"
    assert [p for spec in hooks for p in spec["target_modules"]] == [
        f"{text}.layers.3", f"{text}.layers.4.input_layernorm", f"{text}.layers.32.input_layernorm",
        f"{text}.layers.60.input_layernorm", f"{text}.norm"]


def test_a_cuda_graph_json_would_turn_prefill_graphs_back_on_so_serve_refuses_it(resolved):
    assert resolved["hstap+graph-json"]["prefill_cuda_graph_backend"] == "breakable"
    with pytest.raises(HstapError, match="--cuda-graph-config"):
        check_flags(engine_spec("sglang"), GRAPH_JSON)
