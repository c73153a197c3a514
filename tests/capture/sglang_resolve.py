"""Resolve SGLang's server arguments with SGLang's own code, as its launcher does, on a machine it is told is a GPU one.

    python tests/capture/sglang_resolve.py '{"sm90": ["--model-path", DIR, "--tp-size", "8", ...], ...}'

prints one JSON object: per name, from the published config, the FlashInfer all-reduce fusion backend (what the
layer-boundary fusion check reads, srt/layers/layer_boundary/residual/add_norm.py:149) and the prefill CUDA-graph
backend, the resolved switches of the other paths that skip a module's `__call__` or slice the residual
(`PATHS`), and the fusion lines SGLang logged. A name ending in `@cpu` keeps this machine's platform facts.

Runs SGLang 0.5.23's `prepare_server_args` (server_args.py:668) and `ServerArgs.resolve_once` (server_args.py:244)
and publishes the result (runtime_context.py:1489). Only what reads hardware SGLang cannot have here is replaced:
- the platform facts, through SGLang's own `override_platform` (runtime_context.py:1950), answered as an H100/H200;
- `get_device()` (utils/common.py:1073, called at arg_groups/serving_hook.py:652), answered "cuda" as on a GPU;
- `sglang.srt.utils.is_cuda()`, which the default prefill CUDA-graph backend reads directly
  (model_executor/cuda_graph_config.py:119-123), answered True inside that one function only;
- torchvision's fake-kernel registrations: the PyPI wheel's C++ ops are built for CUDA torch and do not load on
  this CPU torch, so `torchvision._meta_registrations` (which registers fakes for them) is skipped. SGLang needs
  torchvision only for image-preprocessing constants (srt/multimodal/internvl_utils.py:5).
Each resolution runs in a forked child: resolving sets process state (environment variables, the published
config) that must not carry into the next one. Needs the packages of requirements-sglang-resolve.txt on sys.path.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from unittest import mock

H100 = dict(is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False, is_mps=False, is_sm90=True,
            is_sm100=False, is_sm100_or_sm110=False, is_sm110=False, is_sm120=False, is_blackwell=False,
            is_hopper_with_cuda_12_3=True, has_flashinfer=True, device_sm=90, device_capability=(9, 0))


# two-batch / single-batch overlap, torch.compile, DP attention, a2a MoE, attention-TP input scatter, LayerNorm SP,
# ROCm's aiter fusion, and the prefix cache
PATHS = ("enable_two_batch_overlap", "enable_single_batch_overlap", "enable_torch_compile", "attn_dp_size",
         "moe_a2a_backend", "enable_attn_tp_input_scattered", "enable_layernorm_sp", "enable_aiter_allreduce_fusion",
         "disable_radix_cache")


class _Lines(logging.Handler):
    """The fusion lines SGLang logs while resolving (arg_groups/overrides.py:997-999, 1010-1013)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "fusion" in message.lower():
            self.lines.append(message)


def _resolve(argv: list[str], gpu: bool) -> dict:
    from sglang.srt import utils
    from sglang.srt.arg_groups import serving_hook
    from sglang.srt.model_executor import cuda_graph_config
    from sglang.srt.runtime_context import get_exec, override_platform, publish
    from sglang.srt.server_args import prepare_server_args

    serving_hook.get_device = lambda device_id=None: "cuda"
    if gpu:
        default_prefill_backend = cuda_graph_config.default_prefill_backend

        def on_cuda() -> str:
            with mock.patch.object(utils, "is_cuda", lambda: True):
                return default_prefill_backend()

        cuda_graph_config.default_prefill_backend = on_cuda
    lines = _Lines()
    logging.getLogger("sglang.srt.arg_groups.overrides").addHandler(lines)  # survives basicConfig(force=True)
    with override_platform(**(H100 if gpu else {})):
        args = prepare_server_args(argv)
        args.resolve_once()
        publish(args, role="scheduler")
        prefill = get_exec().graph.cuda_graph_config.prefill.backend
        resolved = args.resolved_dict()
        return {"flashinfer_allreduce_fusion_backend": get_exec().comm.flashinfer_allreduce_fusion_backend,
                "prefill_cuda_graph_backend": str(getattr(prefill, "value", prefill)), "lines": lines.lines,
                "paths": {name: resolved[name] for name in PATHS}}


def _in_child(argv: list[str], gpu: bool) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = _resolve(argv, gpu)
        except BaseException as exc:  # noqa: BLE001 — reported to the parent, which fails the test with it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": "the resolving child died without an answer"}


def main(runs: dict[str, list[str]]) -> dict[str, dict]:
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import sglang.srt.arg_groups.pipeline  # noqa: F401 — the heavy imports once, before forking

    return {name: _in_child(argv, gpu=not name.endswith("@cpu")) for name, argv in runs.items()}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
