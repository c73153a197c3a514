"""`hstap vllm-flags --model M --layers auto --out DIR`: vLLM's launch flags and the `install_taps` call for them."""

from __future__ import annotations

import json

from hstap.capture.config import VllmFlagsConfig
from hstap.config import add_config_flags


def add_arguments(parser) -> None:
    add_config_flags(parser, VllmFlagsConfig, "vllm-flags")


def rpc_body(config_json: str) -> str:
    """The body of `POST /collective_rpc` (vLLM's dev endpoint passes string args only)."""
    return json.dumps({"method": "install_taps", "args": [config_json]})


def run(cfg: VllmFlagsConfig) -> int:
    from hstap.capture.engine_session import EngineCaptureConfig
    from hstap.capture.sglang import format_flags
    from hstap.capture.vllm import LAUNCH_FLAGS

    engine = EngineCaptureConfig.for_checkpoint(cfg.model, cfg.layers, cfg.out, "vllm", dtype=cfg.dtype,
                                                shard_mb=cfg.shard_mb, flush_s=cfg.flush_s)
    if cfg.vllm_route == "extract":
        from hstap.capture.vllm_extract import plan_for, write_plan
        from hstap.errors import HstapError

        if cfg.rpc:
            raise HstapError("--rpc: the extract route makes no collective_rpc call (it has no taps to install)")

        plan = plan_for(engine, cfg.model)
        print(f"# vLLM's extract_hidden_states route (plan for capture-remote: {write_plan(plan)}):\n"
              f"{format_flags(plan.launch_flags())}")
        return 0
    body = rpc_body(engine.model_dump_json())
    if cfg.rpc:
        print(body)
        return 0
    print(f"# launch (VLLM_SERVER_DEV_MODE=1 enables POST /collective_rpc):\n{format_flags(LAUNCH_FLAGS)}")
    print(f"# then start the taps in every worker:\ncurl -s -X POST http://127.0.0.1:8000/collective_rpc "
          f"-H 'content-type: application/json' -d {format_flags([body])}")
    return 0
