"""The engines `hstap serve` knows: how to launch each, what capture adds, what it refuses, how it says ready.

    from hstap.serve.engines import ENGINES, engine_spec
    spec = engine_spec("sglang")
    argv, env = spec.command(model_dir, "127.0.0.1", 30000, capture_cfg, ["--tp-size", "2"])

One registry (`ENGINES`); an unknown name lists the valid ones. The launch commands and flags were checked
against the pinned engines' own argument parsers (SGLang 0.5.23, vLLM 0.33.0); see docs/engines.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from hstap.errors import HstapError

if TYPE_CHECKING:  # the capture config pulls in torch: `hstap serve` without capture starts without it
    from hstap.capture.engine import EngineCaptureConfig

# flag -> why capture refuses it (a flag given as `--flag`, `--flag=value`, or `--flag value`)
SGLANG_REFUSED = {
    "--enable-two-batch-overlap": "two-batch overlap splits each forward into micro-batches with their own streams",
    "--enable-single-batch-overlap": "it overlaps communication into the layer boundary the taps read",
    "--enable-flashinfer-allreduce-fusion": "the fused all-reduce+add+norm kernel bypasses the norm module the "
                                            "taps read the residual from",
    "--flashinfer-allreduce-fusion-backend": "the fused all-reduce+add+norm kernel bypasses the norm module",
    "--enable-torch-compile": "compiled graphs do not run Python forward hooks",
    "--forward-hooks": "hstap sets --forward-hooks itself",
    "--cuda-graph-backend-prefill": "hstap sets it to disabled: prefill CUDA graphs replay without hooks",
    "--enable-dp-attention": "use --attn-dp-size; each DP group then writes DIR/dp<R>",
}
VLLM_REFUSED = {
    "--enable-prefix-caching": "a prefix-cache hit skips the cached tokens: the sample would have holes",
    "--worker-extension-cls": "hstap sets its own worker extension",
    "--compilation-config": "hooks need --enforce-eager (torch.compile ignores hooks added later)",
    "-cc": "hooks need --enforce-eager (torch.compile ignores hooks added later)",
}
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
    launcher: Callable[[str, str, int, EngineCaptureConfig | None], tuple[list[str], list[str]]]
    capture_env: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    must_be: dict[str, str] = field(default_factory=dict)
    # (path, JSON body) of a request the supervisor sends once the engine says ready: start-up ends when it is
    # answered (a hang in it is caught by the stall watchdog). None where the engine's own warm-up request
    # precedes its ready line (SGLang) or no token-id endpoint is known to be safe to call (vLLM).
    first_request: tuple[str, dict] | None = None

    def command(self, model: str, host: str, port: int, capture: EngineCaptureConfig | None, extra: list[str],
                program: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment); refuses extra flags that would break capture. `program` replaces the
        launcher program (a wrapper script, a container, a test double), keeping its arguments."""
        if capture is not None:
            check_flags(self, extra)
        env = dict(self.capture_env) if capture is not None else {}
        launcher, args = self.launcher(model, host, port, capture)
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


def check_flags(spec: EngineSpec, extra: list[str]) -> None:
    """Refuse engine flags that break capture, in any spelling the engine's own parser accepts."""
    for i, arg in enumerate(extra):
        given, _, inline = arg.partition("=")
        flag = _as_engine_reads_it(given, spec)
        if flag in spec.refused:
            raise HstapError(f"{spec.name} flag {given} breaks capture: {spec.refused[flag]}; drop it or serve "
                             "without --capture-dir")
        if flag in spec.must_be:
            value = inline or (extra[i + 1] if i + 1 < len(extra) else "")
            if value != spec.must_be[flag]:
                raise HstapError(f"{spec.name} flag {given} {value}: capture needs {flag} {spec.must_be[flag]} "
                                 "(one writer per store sees every layer and every token)")


def _sglang(model: str, host: str, port: int, capture: EngineCaptureConfig | None) -> tuple[list[str], list[str]]:
    args = ["--model-path", model, "--host", host, "--port", str(port)]
    if capture is not None:
        from hstap.capture.sglang import sglang_flags

        args += sglang_flags(capture)
    return [sys.executable, "-m", "sglang.launch_server"], args


def _vllm(model: str, host: str, port: int, capture: EngineCaptureConfig | None) -> tuple[list[str], list[str]]:
    from hstap.capture.vllm import LAUNCH_FLAGS

    args = ["serve", model, "--host", host, "--port", str(port)]  # `vllm serve` (vllm/entrypoints/cli/main.py)
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"], args + (list(LAUNCH_FLAGS) if capture else [])


def _hf(model: str, host: str, port: int, capture: EngineCaptureConfig | None) -> tuple[list[str], list[str]]:
    args = ["--model", model, "--host", host, "--port", str(port)]
    if capture is not None:
        args += ["--capture-layers", ",".join(map(str, capture.layers)), "--capture-dir", str(capture.out),
                 "--dtype", capture.dtype]
    return [sys.executable, "-m", "hstap.serve.hf_capture"], args


ENGINES: dict[str, EngineSpec] = {
    # sglang/srt/entrypoints/http_server.py logs this after its warmup request; /health answers 200 once up.
    "sglang": EngineSpec("sglang", "The server is fired up and ready to roll!", "/health", _sglang,
                         refused=SGLANG_REFUSED, must_be=SGLANG_MUST_BE),
    # vLLM's /health is 200 once the engine core is up; uvicorn logs this line when the app starts.
    "vllm": EngineSpec("vllm", "Application startup complete.", "/health", _vllm,
                       capture_env={"VLLM_SERVER_DEV_MODE": "1"}, refused=VLLM_REFUSED, must_be=VLLM_MUST_BE),
    "hf": EngineSpec("hf", "Application startup complete.", "/health", _hf,
                     first_request=("/v1/completions", {"prompt": [0], "max_tokens": 1, "temperature": 0})),
}


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise HstapError(f"--engine {name!r}: expected one of {sorted(ENGINES)}") from None
