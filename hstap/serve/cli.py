"""`hstap serve --engine sglang|vllm|hf --model M [--capture-layers L --capture-dir DIR] -- <engine args>`."""

from __future__ import annotations

import shlex
import signal
import threading

from hstap.config import add_config_flags, plan_text
from hstap.serve.config import ServeConfig


def add_arguments(parser) -> None:
    parser.description = ServeConfig.__doc__.split("\n\n")[1].strip()
    add_config_flags(parser, ServeConfig, "serve")


def plan(cfg: ServeConfig) -> str:
    """The resolved config and the exact engine command."""
    from hstap.serve.supervisor import Supervisor

    argv, env = Supervisor(cfg).command()
    return plan_text(cfg, "serve") + "# engine command:\n# " + " ".join(f"{k}={v}" for k, v in env.items()) + \
        (" " if env else "") + shlex.join(argv) + "\n"


def run(cfg: ServeConfig) -> int:
    from hstap.serve.supervisor import Supervisor, format_result

    sup = Supervisor(cfg)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.start()
        result = sup.wait_ready(stop)
        if result is None:
            failed = ""
            if cfg.engine == "vllm" and cfg.capture_dir is not None:
                failed = install_vllm_taps(sup) if cfg.vllm_route == "extension" else write_extract_plan(sup)
            if failed:
                result = sup.stop("capture_failed", failed)
            else:
                print(f"hstap serve: {cfg.engine} ready on {sup.url}; Ctrl-C stops it", flush=True)
                result = sup.watch(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(format_result(result, sup.log_path), flush=True)
    if result.status in ("stopped", "interrupted") and not result.survivors:
        return 0 if result.status == "stopped" else 130
    return 1


def install_vllm_taps(sup) -> str:
    """vLLM has no hook flag: start the taps in every worker through its dev RPC endpoint. Returns '' or, when a
    worker refused (a module name that is not in the served model), the one-line reason."""
    import httpx

    from hstap.capture.engine_session import EngineCaptureConfig
    from hstap.capture.vllm_cli import rpc_body

    cfg = EngineCaptureConfig.for_checkpoint(sup.cfg.model, sup.cfg.capture_layers or "auto", sup.cfg.capture_dir,
                                             "vllm")
    r = httpx.post(f"{sup.url}/collective_rpc", content=rpc_body(cfg.model_dump_json()),
                   headers={"content-type": "application/json"}, timeout=120)
    print(f"hstap serve: install_taps -> HTTP {r.status_code} {r.text[:300]}", flush=True)
    if r.status_code != 200:
        return f"vLLM refused install_taps (HTTP {r.status_code}): {' '.join(r.text.split())[:300]}"
    return ""


def write_extract_plan(sup) -> str:
    """vLLM's extract route needs no call into the engine: write DIR/vllm-extract.json (the layers in both id
    conventions, where vLLM's files go, the teacher's norm) for `capture-remote --vllm-route extract`."""
    from hstap.capture.engine_session import EngineCaptureConfig
    from hstap.capture.vllm_extract import plan_for, write_plan

    cfg = EngineCaptureConfig.for_checkpoint(sup.cfg.model, sup.cfg.capture_layers or "auto", sup.cfg.capture_dir,
                                             "vllm")
    plan = plan_for(cfg, sup.cfg.model)
    print(f"hstap serve: extract route: canonical layers {plan.layers} = vLLM aux ids {plan.vllm_ids} (the last for "
          f"the teacher); vLLM writes {plan.storage}, plan in {write_plan(plan)}", flush=True)
    return ""
