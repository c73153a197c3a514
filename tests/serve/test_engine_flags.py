"""`check_flags` refuses the engine flags that break capture, in every spelling, and lets every other flag through."""

from __future__ import annotations

import re

import pytest

from hstap.errors import HstapError
from hstap.serve.engines import check_flags, engine_spec

# (engine, extra arguments, the flag the error must name)
REFUSED = [
    pytest.param("sglang", ["--enable-torch-compile"], "--enable-torch-compile", id="sglang-bare-flag"),
    pytest.param("sglang", ["--forward-hooks=[]"], "--forward-hooks", id="sglang-flag=value"),
    pytest.param("sglang", ["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill",
                 id="sglang-flag-value"),
    pytest.param("sglang", ["--tp-size", "2", "--enable-dp-attention"], "--enable-dp-attention",
                 id="sglang-after-an-allowed-flag"),
    pytest.param("sglang", ["--enable-two-batch-overlap"], "--enable-two-batch-overlap", id="sglang-tbo"),
    pytest.param("sglang", ["--enable-single-batch-overlap"], "--enable-single-batch-overlap", id="sglang-sbo"),
    pytest.param("sglang", ["--enable-flashinfer-allreduce-fusion"], "--enable-flashinfer-allreduce-fusion",
                 id="sglang-allreduce-fusion"),
    pytest.param("sglang", ["--flashinfer-allreduce-fusion-backend=auto"], "--flashinfer-allreduce-fusion-backend",
                 id="sglang-allreduce-fusion-backend"),
    pytest.param("sglang", ["--enable-aiter-allreduce-fusion"], "--enable-aiter-allreduce-fusion",
                 id="sglang-aiter-allreduce-fusion"),
    pytest.param("sglang", ["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'], "--cuda-graph-config",
                 id="sglang-cuda-graph-config"),
    pytest.param("sglang", ["--config", "serve.yaml"], "--config", id="sglang-config-file"),
    pytest.param("sglang", ["--enable-attn-tp-input-scattered"], "--enable-attn-tp-input-scattered",
                 id="sglang-attn-tp-input-scattered"),
    pytest.param("sglang", ["--enable-layernorm-sp"], "--enable-layernorm-sp", id="sglang-layernorm-sp"),
    pytest.param("sglang", ["--pp-size", "2"], "--pp-size", id="sglang-pp-size-2"),
    pytest.param("sglang", ["--pp-size=2"], "--pp-size", id="sglang-pp-size=2"),
    pytest.param("sglang", ["--pipeline-parallel-size", "4"], "--pipeline-parallel-size", id="sglang-pp-long-name"),
    pytest.param("sglang", ["--attn-cp-size", "2"], "--attn-cp-size", id="sglang-attn-cp-size-2"),
    pytest.param("sglang", ["--pp-size"], "--pp-size", id="sglang-pp-size-without-value"),
    pytest.param("sglang", ["--pp-size", "1", "--pp-size", "2"], "--pp-size", id="sglang-later-pp-size-wins"),
    pytest.param("vllm", ["--enable-prefix-caching"], "--enable-prefix-caching", id="vllm-prefix-caching"),
    pytest.param("vllm", ["--worker-extension-cls", "my.Ext"], "--worker-extension-cls", id="vllm-extension"),
    pytest.param("vllm", ["--compilation-config", '{"mode": 3}'], "--compilation-config", id="vllm-compile-config"),
    pytest.param("vllm", ['--compilation-config={"mode": 3}'], "--compilation-config",
                 id="vllm-compile-config=value"),
    pytest.param("vllm", ["-cc", '{"mode": 3}'], "-cc", id="vllm-short-cc"),
    pytest.param("vllm", ["-pp", "2"], "-pp", id="vllm-short-pp-2"),
    pytest.param("vllm", ["--pipeline-parallel-size=2"], "--pipeline-parallel-size", id="vllm-pp=2"),
    pytest.param("vllm", ["--pipeline-parallel-size", "3"], "--pipeline-parallel-size", id="vllm-pp-3"),
    # SGLang 0.5.23 registers --attention-context-parallel-size as an alias of --attn-cp-size (its parser)
    pytest.param("sglang", ["--attention-context-parallel-size", "2"], "--attention-context-parallel-size",
                 id="sglang-attn-cp-alias"),
    # vLLM's FlexibleArgumentParser reads underscores in flag names as dashes
    pytest.param("vllm", ["--enable_prefix_caching"], "--enable_prefix_caching", id="vllm-underscore-spelling"),
    # both engines' argparse accept an unambiguous prefix of a flag
    pytest.param("sglang", ["--enable-two-batch"], "--enable-two-batch", id="sglang-abbreviated-tbo"),
    pytest.param("sglang", ["--pipeline-parallel", "2"], "--pipeline-parallel", id="sglang-abbreviated-pp-2"),
]


@pytest.mark.parametrize("engine, extra, flag", REFUSED)
def test_refused(engine, extra, flag):
    with pytest.raises(HstapError, match=re.escape(flag)) as info:
        check_flags(engine_spec(engine), extra)
    assert engine in str(info.value)


# (engine, extra arguments that capture accepts)
ALLOWED = [
    pytest.param("sglang", [], id="sglang-nothing"),
    pytest.param("sglang", ["--tp-size", "2", "--mem-fraction-static", "0.8"], id="sglang-unrelated"),
    pytest.param("sglang", ["--pp-size", "1"], id="sglang-pp-size-1"),
    pytest.param("sglang", ["--pp-size=1"], id="sglang-pp-size=1"),
    pytest.param("sglang", ["--pipeline-parallel-size", "1", "--attn-cp-size=1"], id="sglang-must-be-values"),
    pytest.param("sglang", ["--enable-torch-compile-debug-mode"], id="sglang-longer-flag-sharing-a-prefix"),
    pytest.param("sglang", ["--disable-cuda-graph"], id="sglang-disable-cuda-graph"),
    pytest.param("sglang", ["--enable-prefix-caching"], id="sglang-ignores-vllm-refusals"),
    pytest.param("vllm", ["--tensor-parallel-size", "2", "--max-model-len", "4096"], id="vllm-unrelated"),
    pytest.param("vllm", ["--no-enable-prefix-caching"], id="vllm-prefix-caching-off"),
    pytest.param("vllm", ["-pp", "1"], id="vllm-short-pp-1"),
    pytest.param("vllm", ["--pipeline-parallel-size=1"], id="vllm-pp=1"),
    pytest.param("vllm", ["--enable-torch-compile", "--pp-size", "2"], id="vllm-ignores-sglang-refusals"),
    pytest.param("hf", ["--enable-prefix-caching", "--pp-size", "2"], id="hf-refuses-nothing"),
]


@pytest.mark.parametrize("engine, extra", ALLOWED)
def test_allowed(engine, extra):
    check_flags(engine_spec(engine), extra)  # raises nothing


def test_the_error_says_what_capture_needs():
    with pytest.raises(HstapError) as info:
        check_flags(engine_spec("sglang"), ["--pp-size", "2"])
    assert "--pp-size 2" in str(info.value) and "--pp-size 1" in str(info.value)


def test_unknown_engine_lists_the_valid_ones():
    with pytest.raises(HstapError, match=re.escape("['hf', 'sglang', 'vllm']")):
        engine_spec("tgi")


@pytest.mark.parametrize("engine, module", [("vllm", "vllm.entrypoints.openai.api_server"), ("sglang", "sglang.launch_server"),
                                            ("hf", "hstap.serve.hf_capture")])
def test_the_engine_runs_under_the_python_of_its_own_environment(engine, module, tmp_path):
    """`--engine-python` puts the engine's own interpreter in front of its launcher (engines pin their own torch
    and transformers, so they live in an environment beside hstap's); without it, hstap's own Python runs it."""
    import sys

    spec = engine_spec(engine)
    argv, _ = spec.command("/ckpt", "127.0.0.1", 8000, None, [], python=str(tmp_path / "bin" / "python"))
    assert argv[:3] == [str(tmp_path / "bin" / "python"), "-m", module]
    assert spec.command("/ckpt", "127.0.0.1", 8000, None, [])[0][0] == sys.executable
