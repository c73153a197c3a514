"""A stand-in engine for the supervisor tests: `python fake_engine.py MODE [engine args...]`.

MODE `hang`: prints SGLang-like loading lines, announces warmup, starts two workers that spin (one of them in its
own session, out of the process group, as a detached scheduler would be) and then busy-loops itself.
MODE `crash`: prints loading lines and dies with a traceback, exit code 3.
MODE `healthy`: prints SGLang's ready line and answers GET /health on --port; two idle worker children, one of
them in its own session (out of the process group).
MODE `silent`: `healthy`, after the line hstap's own taps print when their hooks never fire.
MODE `liar`: prints SGLang's ready line but never listens (another process's server may answer on its port).
MODE `nomatch` / `twomatch`: `healthy`, after logging what SGLang 0.5.23's hook_manager logs for the
`--forward-hooks` specs it was given: every spec registered on its first pattern, except the last spec, which
matched no module (`nomatch`), or the first spec, registered on a second module too (`twomatch`); each such
line is logged once per TP rank, as SGLang's workers do. Then it answers POST /v1/completions with 200 too.
MODE `fusion` / `fusion_off`: `healthy`, after the line SGLang 0.5.23 logs when it auto-enables the FlashInfer
all-reduce fusion (srt/arg_groups/overrides.py:997-999) and then (`fusion_off` only) the line its enforce-disable
pass logs right after it (overrides.py:1010-1013), as a launch with --enforce-disable-flashinfer-allreduce-fusion does.
Every pid it starts is appended to $FAKE_PIDS (one per line) so the test can check that none survives.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def record(pid: int) -> None:
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{pid}\n")


def spin_forever() -> None:
    x = 0
    while True:  # the seed's scheduler: 100 % CPU, no progress, no output
        x += 1


def worker(cmd: str, detach: bool = False) -> None:
    child = subprocess.Popen([sys.executable, "-c", cmd], start_new_session=detach)
    record(child.pid)


def log_hook_registration(specs: list, mode: str) -> None:
    for rank in range(2):
        for i, spec in enumerate(specs):
            head = f"[2026-11-29 10:00:03 TP{rank}]"
            if mode == "nomatch" and i == len(specs) - 1:
                print(f"{head} WARNING: No modules matched hook spec '{spec['name']}' "
                      f"patterns={spec['target_modules']}", flush=True)
                continue
            print(f"{head} Registered forward hook '{spec['name']}' on {spec['target_modules'][0]}", flush=True)
            if mode == "twomatch" and i == 0:
                print(f"{head} Registered forward hook '{spec['name']}' on vision_tower.layers.1", flush=True)


def main() -> None:
    mode = sys.argv[1]
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--forward-hooks", default="[]")
    args, _ = ap.parse_known_args(sys.argv[2:])
    record(os.getpid())
    print("[2026-11-29 10:00:00] Load weight begin. avail mem=139.00 GB", flush=True)
    print("[2026-11-29 10:00:01] Loading safetensors checkpoint shards: 100% 4/4", flush=True)
    if mode == "crash":
        print("Traceback (most recent call last):", flush=True)
        print('  File "model_runner.py", line 412, in init_memory_pool', flush=True)
        print("RuntimeError: CUDA out of memory (fake): tried to allocate 20.00 GiB", flush=True)
        sys.exit(3)
    if mode == "hang":
        print("[2026-11-29 10:00:02] Capture cuda graph begin. Warmup request sent.", flush=True)
        worker("while True: pass")
        worker("while True: pass", detach=True)
        spin_forever()
    if mode == "liar":
        print("The server is fired up and ready to roll!", flush=True)
        time.sleep(300)  # bounded: a fake engine never outlives a test run by much
    if mode in ("nomatch", "twomatch"):
        log_hook_registration(json.loads(args.forward_hooks), mode)
    if mode in ("fusion", "fusion_off"):
        print("[2026-12-06 01:03:06] Auto-enabling FlashInfer AllReduce Fusion (auto) for "
              "KimiK25ForConditionalGeneration", file=sys.stderr, flush=True)
        if mode == "fusion_off":
            print("[2026-12-06 01:03:06] FlashInfer allreduce fusion is forcibly disabled via "
                  "--enforce-disable-flashinfer-allreduce-fusion.", file=sys.stderr, flush=True)
        print("[2026-12-06 01:03:06] Attention backend not specified. Use triton backend by default.",
              file=sys.stderr, flush=True)
    if mode == "silent":
        print("hstap capture: error: the capture hooks on model.layers.1 (hidden.1) never fired in 4 prefill "
              "requests, so nothing was captured", file=sys.stderr, flush=True)
    if mode in ("healthy", "nomatch", "twomatch", "silent", "fusion", "fusion_off"):
        from http.server import BaseHTTPRequestHandler, HTTPServer

        class Health(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                body = b'{"choices": [{"text": "."}]}'
                self.send_response(200 if self.path == "/v1/completions" else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        worker("import time; time.sleep(600)")
        worker("import time; time.sleep(600)", detach=True)
        server = HTTPServer(("127.0.0.1", args.port), Health)
        print("The server is fired up and ready to roll!", flush=True)
        deadline = time.monotonic() + 300  # bounded: a fake engine never outlives a test run by much
        server.timeout = 0.5
        while time.monotonic() < deadline:
            server.handle_request()


if __name__ == "__main__":
    main()
