"""`hstap serve` and `capture-remote` under injected faults: how each ends, how fast, and what is left running.

    .venv/bin/python bench/serve_faults.py [--only NAME ...] [--stall-load 5] [--stall-model 90]

Runs on a CPU with the real `hf` engine (SmolLM2) and the suite's fake engine (tests/serve/fake_engine.py):
- a hang injected with HSTAP_FAULT in each start-up phase of the hf engine (`hang-loading`, `hang-warmup`,
  `hang-first-request`), and the fake engine's busy loop in warm-up: how long after the engine's last log line
  the supervisor called it a hang, how long the stacks took (py-spy, or faulthandler with `--no-py-spy` rows),
  and when everything was stopped;
- `kill -9`, SIGTERM and SIGINT of the supervisor (the fake engine with two workers, one in a session of its own;
  and the real hf engine for kill -9): seconds until no process of the engine is left;
- a port another process holds, and `capture-remote` against a URL where nothing listens: seconds to the error.
Every row counts the engine processes still alive at the end (psutil): that must be 0. Prints one table (Markdown).
`--stall-model` must exceed the hf engine's silent model load (~15 s here, which the busy rule halves).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FAKE = ROOT / "tests" / "serve" / "fake_engine.py"

import harness  # noqa: E402
from hstap.cli import main as hstap  # noqa: E402
from hstap.serve import stacks  # noqa: E402
from hstap.serve.config import ServeConfig  # noqa: E402
from hstap.serve.ports import free_port  # noqa: E402
from hstap.serve.supervisor import Supervisor  # noqa: E402


def alive(pids) -> int:
    n = 0
    for pid in pids:
        try:
            n += psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass
    return n


def hang(phase: str, stall: float, py_spy: bool, run_dir: Path, engine: str = "hf") -> dict:
    """One supervised start-up with a hang in `phase`: the supervisor's own clock, read around its steps."""
    os.environ["HSTAP_FAULT"] = f"hang-{phase}"
    os.environ["FAKE_PIDS"] = str(run_dir / "pids")
    if engine == "hf":
        cfg = ServeConfig(engine="hf", model="smollm2", port=free_port(), run_dir=run_dir, stall_timeout=stall,
                          grace_s=2, echo=False)
    else:  # the fake engine's busy loop in warm-up (SGLang-like log lines)
        cfg = ServeConfig(engine="sglang", model="smollm2", port=free_port(), run_dir=run_dir, stall_timeout=stall,
                          grace_s=2, command=[sys.executable, str(FAKE), "hang"], echo=False)
    original, marks = stacks.py_spy, {}
    if not py_spy:
        stacks.py_spy = lambda: None
    sup = Supervisor(cfg)
    dump = sup._dump_stacks

    def timed_dump():
        marks["hang"], marks["silent"] = time.monotonic(), time.monotonic() - sup._last_output
        out = dump()
        marks["stacks"] = time.monotonic() - marks["hang"]
        return out

    sup._dump_stacks = timed_dump
    try:
        sup.start()
        result = sup.wait_ready()
    finally:
        stacks.py_spy = original
        os.environ.pop("HSTAP_FAULT")
    stopped = time.monotonic() - marks.get("hang", time.monotonic())
    dumps = sorted((run_dir / "stacks").glob("*.txt"))
    named = sum("fault_point" in f.read_text() or "spin_forever" in f.read_text() for f in dumps)
    return {"fault": f"{engine} hang-{phase}" if engine == "hf" else "fake busy loop in warm-up",
            "setting": f"--stall-timeout {stall:g}", "ended": f"{result.status} during {result.phase}",
            "detected (s after last line)": f"{marks['silent']:.1f}",
            "stacks": f"{len(dumps)} processes by {'py-spy' if py_spy else 'faulthandler'} in {marks['stacks']:.1f} s"
                      f" ({named} name the hung frame)",
            "all stopped (s after detection)": f"{stopped - marks['stacks']:.1f}",
            "left alive": alive(list(sup._known)), "since start (s)": f"{result.elapsed_s:.1f}"}


def killed(sig: int, run_dir: Path, engine: str = "fake") -> dict:
    """`hstap serve` made ready, then sent `sig`; seconds until no process of its tree is left."""
    port = free_port()
    cmd = [sys.executable, "-m", "hstap.cli", "serve", "--model", "smollm2", "--port", str(port), "--run-dir",
           str(run_dir), "--grace", "2"]
    cmd += (["--engine", "hf"] if engine == "hf" else
            ["--engine", "sglang", "--command", f"{sys.executable} {FAKE} healthy"])
    env = {**os.environ, "FAKE_PIDS": str(run_dir / "pids"), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    serve = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    while "Ctrl-C stops it" not in line:
        line = serve.stdout.readline()
        if not line:
            raise SystemExit(f"serve never became ready: {cmd}")
    ready = time.monotonic() - start
    tree = psutil.Process(serve.pid).children(recursive=True)
    sent = time.monotonic()
    serve.send_signal(sig)
    serve.communicate(timeout=120)
    while alive(p.pid for p in tree) and time.monotonic() - sent < 120:  # exited, or a zombie not yet reaped
        time.sleep(0.01)
    gone = time.monotonic() - sent
    return {"fault": f"{signal.Signals(sig).name} to the supervisor ({engine} engine, ready after {ready:.0f} s)",
            "setting": "--grace 2", "ended": f"serve exit {serve.returncode}",
            "detected (s after last line)": "–", "stacks": "–",
            "all stopped (s after detection)": f"{gone:.1f} ({len(tree)} processes)",
            "left alive": alive(p.pid for p in tree), "since start (s)": f"{time.monotonic() - start:.1f}"}


def one_line(args: list[str]) -> tuple[int, str, float]:
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = hstap(args)
    return code, err.getvalue().strip(), time.monotonic() - start


def taken_port(run_dir: Path) -> dict:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        code, err, took = one_line(["serve", "--engine", "hf", "--model", "smollm2", "--port",
                                    str(holder.getsockname()[1]), "--run-dir", str(run_dir)])
    return {"fault": "serve's port held by another process", "setting": "–",
            "ended": f"exit {code}: {err[:90]}…", "detected (s after last line)": f"{took:.2f} (whole command)",
            "stacks": "–", "all stopped (s after detection)": "nothing started", "left alive": 0,
            "since start (s)": f"{took:.2f}"}


def dead_url(run_dir: Path) -> dict:
    from hstap.models import load_tokenizer

    load_tokenizer("smollm2")  # transformers' import, once: not part of the figure
    data = run_dir / "conv.jsonl"
    data.write_text('{"id": "c0", "messages": [{"role": "user", "content": "Hi"}, '
                    '{"role": "assistant", "content": "Hello."}]}\n')
    with socket.socket() as taken:  # bound, not listening: connections are refused
        taken.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{taken.getsockname()[1]}"
        code, err, took = one_line(["capture-remote", "--url", url, "--data", f"jsonl:{data}", "--capture-dir",
                                    str(run_dir / "cap")])
    return {"fault": "capture-remote against a URL where nothing listens", "setting": "--retries 3 (default)",
            "ended": f"exit {code}: {err[:90]}…", "detected (s after last line)": f"{took:.2f} (whole command, "
                                                                          "tokenizer loaded before)",
            "stacks": "–", "all stopped (s after detection)": "–", "left alive": 0, "since start (s)": f"{took:.2f}"}


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    ap.add_argument("--stall-load", type=float, default=5.0, help="stall timeout for the loading hang")
    ap.add_argument("--stall-model", type=float, default=90.0, help="stall timeout for warm-up/first-request hangs")
    args = ap.parse_args()
    bench_run = harness.start(args)
    rows = {
        "hang-loading": lambda d: hang("loading", args.stall_load, True, d),
        "hang-loading-faulthandler": lambda d: hang("loading", args.stall_load, False, d),
        "hang-warmup": lambda d: hang("warmup", args.stall_model, True, d),
        "hang-first-request": lambda d: hang("first-request", args.stall_model, False, d),
        "busy-loop": lambda d: hang("warmup", 6.0, True, d, engine="fake"),
        "kill-9": lambda d: killed(signal.SIGKILL, d),
        "sigterm": lambda d: killed(signal.SIGTERM, d),
        "sigint": lambda d: killed(signal.SIGINT, d),
        "kill-9-hf": lambda d: killed(signal.SIGKILL, d, engine="hf"),
        "taken-port": taken_port,
        "dead-url": dead_url,
    }
    print(f"# bench/serve_faults.py on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    table = []
    for name, run in rows.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as d:
            table.append(run(Path(d)))
        print(f"# {name}: {table[-1]}", flush=True)
    keys = list(table[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in table:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    bench_run.finish({"load_average": os.getloadavg()[0], "rows": table})


if __name__ == "__main__":
    main()
