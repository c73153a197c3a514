"""`hstap serve --engine sglang|vllm|hf --model M [--capture-layers L --capture-dir DIR] -- <engine args>`."""

from __future__ import annotations

import argparse
import shlex
import signal
import threading
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start an engine (with capture taps), wait until ready, watch for hangs",
                       description="Everything after `--` goes to the engine unchanged (flags that break "
                                   "capture are refused).")
    p.add_argument("--engine", required=True, help="sglang | vllm | hf")
    p.add_argument("--model", required=True, help="'smollm2' or a checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--capture-layers", default=None, help="'auto' or canonical ids like 1,14,26")
    p.add_argument("--capture-dir", type=Path, default=None, help="store the engine's taps write (enables capture)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/serve"), help="engine.log, stacks/ on a hang")
    p.add_argument("--ready-timeout", type=float, default=1800, help="seconds until the engine must be ready")
    p.add_argument("--stall-timeout", type=float, default=300,
                   help="seconds without log output before ready that count as a hang (half with a core spinning)")
    p.add_argument("--grace", type=float, default=10, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--command", default=None, help="program to run instead of the engine's launcher (a wrapper, "
                                                   "container or test double); it gets the same arguments")
    p.add_argument("--plan", action="store_true", help="print the engine command and exit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then engine arguments")


def run(args: argparse.Namespace) -> int:
    from hstap.serve.supervisor import ServeConfig, Supervisor, format_result

    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    cfg = ServeConfig(engine=args.engine, model=args.model, host=args.host, port=args.port,
                      capture_layers=args.capture_layers, capture_dir=args.capture_dir, run_dir=args.run_dir,
                      ready_timeout=args.ready_timeout, stall_timeout=args.stall_timeout, grace_s=args.grace,
                      command=shlex.split(args.command) if args.command else None, extra=extra)
    sup = Supervisor(cfg)
    if args.plan:
        argv, env = sup.command()
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
        return 0
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.start()
        result = sup.wait_ready(stop)
        if result is None:
            failed = install_vllm_taps(sup) if cfg.engine == "vllm" and cfg.capture_dir is not None else ""
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

    from hstap.capture.engine import EngineCaptureConfig
    from hstap.capture.vllm_cli import rpc_body

    cfg = EngineCaptureConfig.for_checkpoint(sup.cfg.model, sup.cfg.capture_layers or "auto", sup.cfg.capture_dir,
                                             "vllm")
    r = httpx.post(f"{sup.url}/collective_rpc", content=rpc_body(cfg.model_dump_json()),
                   headers={"content-type": "application/json"}, timeout=120)
    print(f"hstap serve: install_taps -> HTTP {r.status_code} {r.text[:300]}", flush=True)
    if r.status_code != 200:
        return f"vLLM refused install_taps (HTTP {r.status_code}): {' '.join(r.text.split())[:300]}"
    return ""
