"""Start an engine, tell when it is ready, catch a hang, and always stop it completely.

    from hstap.serve.config import ServeConfig
    from hstap.serve.supervisor import Supervisor
    sup = Supervisor(ServeConfig(engine="hf", model="smollm2", port=8000, run_dir=Path("runs/serve")))
    sup.start(); sup.wait_ready(); ...; result = sup.stop()          # `hstap serve` adds sup.watch() until Ctrl-C

With capture on, SGLang's log is also read for its hook registrations: a hook spec that matched no module, or more
than one, stops the engine at once with a one-line error naming the spec (status `capture_failed`); so does a
FlashInfer all-reduce fusion SGLang says it enabled (its fused kernel bypasses the input norms the hooks read).

A port that is already taken is refused before anything starts. The engine runs under a keeper
(`hstap.serve.keeper`) in its own process group, tied to the supervisor by a lifeline pipe: however the supervisor
ends, `kill -9` included, the keeper stops the engine and everything it started. Its output is teed to
`RUN_DIR/engine.log` and echoed as progress with the phase (`loading` → `warmup` → `first-request` → `ready`,
never backwards). Ready means: the engine's own ready line, `GET /health` = 200, the listening socket held by a
process of the engine's own tree (another server answering on the port is an error, not readiness) and, for
engines that name a first request (`hf`), an answer to it.
Watchdog, until ready: no new log output for `stall_timeout` seconds — or half of that while some process of the
group burns a full core (a busy loop: the seed story's scheduler spinning on futexes) — and, once ready, the health
endpoint unanswered for `health_timeout` seconds (an idle server is silent; see `watch`) — is a HANG: every process's
Python stacks go to `RUN_DIR/stacks/<pid>.txt` (`hstap.serve.stacks`: py-spy, else faulthandler), the group gets
SIGTERM, then SIGKILL after `grace_s`, and the supervisor checks that no process of it survives. A crash reports
the exit code and the last log lines.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hstap.errors import HstapError
from hstap.preflight import check_out_dir
from hstap.serve import stacks as stack_dumps
from hstap.serve.config import ServeConfig
from hstap.serve.engines import engine_spec
from hstap.serve.ports import check_port_free, describe, listeners

# SGLang 0.5.23's hook_manager logs these per --forward-hooks spec (a spec matching nothing is only a warning, and
# the engine serves on with a capture directory that stays empty). hstap's spec names start with "hstap-".
NO_MATCH = re.compile(r"No modules matched hook spec '(hstap-[^']*)' patterns=(\[.*?\])")
REGISTERED = re.compile(r"Registered forward hook '(hstap-[^']*)' on (\S+)")
CAPTURE_ERROR = re.compile(r"hstap capture: error: (.*)")  # hstap's own taps (hf engine): hooks that never fired
# SGLang logs these while resolving its arguments (0.5.23 srt/arg_groups/overrides.py:997-999 and 1010-1013; 0.5.20
# overrides.py:1045-1047 and 1057-1060). The enforce-disable pass runs right after the auto-enable (0.5.23
# model_hook.py:747-748; 0.5.20 model_hook.py:642-643), so an enable line not followed at once by the disable line
# means the fused kernel replaces the input norms the capture hooks read.
FUSION_ON = re.compile(r"Auto-enabling FlashInfer AllReduce Fusion\b.*? for (\S+)")
FUSION_OFF = re.compile(r"FlashInfer allreduce fusion is forcibly disabled")
# vLLM (0.32) warms up in "init engine (profile, create kv cache, warmup model)" (v1/engine/core.py): a compiled model
# first logs "Warming up model for the compilation..." (CPU worker), an eager one (capture's --enforce-eager) has no
# warm-up run and goes from "<device> KV cache size: N tokens" to allocating the cache and serving. Its "Enforce eager
# set, disabling ... JIT kernel warmup", long before: a line that disables or skips a warm-up is not one. SGLang's
# warm-up starts with its own `GET /model_info` (entrypoints/http_server.py: 0.5.20 :2228, 0.5.23 :2374), logged by
# uvicorn, then sends its /generate; it logs no line of its own before it.
PHASES = [("ready", None), ("first-request", None),
          ("warmup", re.compile(r"^(?!.*(disabl|skipp)).*(warm(ing)?[- ]?up|cuda graph|KV cache size|"
                                r"\"GET /model_info )", re.I)),
          ("loading", re.compile(r"load|weight|shard|init", re.I))]
ORDER = ["starting", "loading", "warmup", "first-request", "ready"]  # a phase only moves forward


@dataclass
class ServeResult:
    """How the engine ended. `status`: stopped | hang | crashed | timeout | interrupted | capture_failed |
    port_taken. `elapsed_s`: seconds since the engine was started."""

    status: str
    exit_code: int | None
    phase: str
    diagnosis: str
    last_lines: list[str] = field(default_factory=list)
    stacks_dir: Path | None = None
    survivors: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "stopped" and not self.survivors


def check_program(program: str, flag: str) -> None:
    """`program` can be started (a path to an executable file, or a name on PATH): else one line now, instead of the
    keeper's FileNotFoundError traceback after serve has started."""
    if shutil.which(program) is not None:
        return
    if os.sep in program:
        why = "no such file" if not os.path.exists(program) else "not an executable file"
    else:
        why = "not found on PATH"
    raise HstapError(f"{flag} {program}: {why}: give the path of the program to run")


class Supervisor:
    """One engine process group, watched."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.spec = engine_spec(cfg.engine, cfg.vllm_route)
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.phase = "starting"
        self.proc: subprocess.Popen | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=30)
        self._last_output = time.monotonic()
        self._ready_line = threading.Event()
        self._known: dict[int, psutil.Process] = {}
        self._cpu_mark: tuple[float, dict[int, float]] = (0.0, {})
        self._reader: threading.Thread | None = None
        self.log_path = cfg.run_dir / "engine.log"
        self.capture_error = ""  # set by the log reader: a capture hook that will never fire as intended
        self._hooked: dict[str, set[str]] = {}  # hook spec -> module names SGLang registered it on
        self._fusion = ""  # the architecture SGLang auto-enabled an all-reduce fusion for, until it disables it
        self._lifeline = -1  # write end of the keeper's lifeline pipe: closed when this process ends
        self._started = 0.0
        self._probe: dict[str, str] = {}  # the first request's outcome: {"error": ""} when it was answered
        self.faulthandler_dir = cfg.run_dir / "faulthandler"

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def command(self) -> tuple[list[str], dict[str, str]]:
        from hstap.models.target import resolve_model_dir

        cfg = self.cfg
        capture = None
        if cfg.capture_dir is not None:
            from hstap.capture.engine_session import EngineCaptureConfig  # torch: only when capturing

            capture = EngineCaptureConfig.for_checkpoint(cfg.model, cfg.capture_layers or "auto", cfg.capture_dir,
                                                         cfg.engine, engine_version=self._engine_version())
        elif cfg.capture_layers is not None:
            raise HstapError("--capture-layers needs --capture-dir (where the engine writes the store)")
        model = cfg.model if cfg.engine == "hf" else str(resolve_model_dir(cfg.model)[0])
        argv, env = self.spec.command(model, cfg.host, cfg.port, capture, cfg.extra, program=cfg.command,
                                      python=str(cfg.engine_python) if cfg.engine_python else None)
        if cfg.drafter is not None or cfg.draft is not None:
            if cfg.engine != "hf":
                raise HstapError(f"--drafter/--draft drive hstap's own hf engine; give {cfg.engine} its own "
                                 "speculative-decoding flags after --")
            argv += (["--drafter", str(cfg.drafter)] if cfg.drafter else []) + (["--draft", cfg.draft]
                                                                                if cfg.draft else [])
        return argv, env

    def _engine_version(self) -> str | None:
        """SGLang's release in the engine's environment (the decoder layers' contract, so the hooked modules, and
        some flags differ between releases); None for other engines or where it cannot be read (a --command
        container): then the hooks are made for the default release, and that is said."""
        from hstap.capture.arch import SGLANG_DEFAULT_VERSION, version_note
        from hstap.serve.engines import installed_version

        if self.cfg.engine != "sglang":
            return None
        python = str(self.cfg.engine_python or sys.executable)
        version = installed_version(python, "sglang")
        self._say(version_note("sglang", version) or f"sglang {version} in {python}" if version else
                  f"no sglang found for {python}: hooks made for SGLang {SGLANG_DEFAULT_VERSION}")
        return version

    def start(self) -> None:
        """Refuse a missing program, an unwritable --run-dir and a taken port, then start the keeper (which starts
        the engine) and the log reader."""
        argv, env = self.command()
        check_program(argv[0], "--command" if self.cfg.command else f"the {self.cfg.engine} engine's program")
        check_out_dir(self.cfg.run_dir, flag="--run-dir")
        if self.cfg.drafter is not None:  # a damaged drafter: one line here, not the engine's crash echoed twice
            from hstap.drafter.integrity import check_drafter
            from hstap.drafter.shipped import resolve_drafter

            check_drafter(resolve_drafter(self.cfg.drafter, flag="--drafter"))
        check_port_free(self.cfg.host, self.cfg.port)
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (self.cfg.run_dir / "command.txt").write_text(" ".join(argv) + "\n")
        self._say(f"starting {self.cfg.engine}: {' '.join(argv)[:300]}")
        lifeline, self._lifeline = os.pipe()
        keeper = [sys.executable, "-m", "hstap.serve.keeper", str(lifeline), str(self.cfg.grace_s), "--"]
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", stack_dumps.ENV: str(self.faulthandler_dir)}
        try:
            self.proc = subprocess.Popen(keeper + argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                         pass_fds=(lifeline,))
        finally:
            os.close(lifeline)  # the keeper's end only: its EOF is this process's death
        self._known[self.proc.pid] = psutil.Process(self.proc.pid)
        self._started = self._last_output = time.monotonic()
        self._reader = threading.Thread(target=self._tee, name="hstap-serve-log", daemon=True)
        self._reader.start()

    def wait_ready(self, stop: threading.Event | None = None) -> ServeResult | None:
        """Block until ready (returns None) or until the engine crashed, hung, timed out or `stop` was set
        (returns how it ended, the group already gone)."""
        started = time.monotonic()
        while True:
            self._track_children()
            code = self.proc.poll()
            if code is not None:
                return self._ended("crashed", f"the engine exited with code {code} during {self.phase}")
            if self.capture_error:
                return self.stop("capture_failed", self.capture_error)
            if stop is not None and stop.is_set():
                return self.stop("interrupted")
            if self._ready_line.is_set() and not self._probe and self._healthy():
                foreign = self._foreign_listener()
                if foreign:
                    return self.stop("port_taken", foreign)
                if self.spec.first_request is None:
                    self._probe["error"] = ""
                else:  # answered in a thread: a hang in it is caught by the watchdog below
                    self._probe["sent"] = "yes"
                    self._advance("first-request")
                    threading.Thread(target=self._first_request, name="hstap-serve-probe", daemon=True).start()
            if "error" in self._probe:
                if self._probe["error"]:
                    return self.stop("crashed", f"the engine's first request failed: {self._probe['error']}")
                self.phase = "ready"
                self._say(f"ready on {self.url} after {time.monotonic() - started:.0f} s")
                return None
            silent = time.monotonic() - self._last_output
            spinning = self._spinning()
            if silent >= self.cfg.stall_timeout or (spinning and silent >= self.cfg.stall_timeout / 2):
                why = f"busy loop: {spinning} spinning on the CPU" if spinning else "processes idle or blocked"
                return self._hang(f"no log output for {silent:.0f} s and not ready ({why})")
            if time.monotonic() - started > self.cfg.ready_timeout:
                return self._hang(f"not ready after --ready-timeout {self.cfg.ready_timeout:.0f} s", "timeout")
            time.sleep(0.2)

    def watch(self, stop: threading.Event) -> ServeResult:
        """While ready: wait for `stop` (Ctrl-C) or for the engine to exit on its own. A ready server is silent
        when idle, so its log cannot tell a hang here: the health endpoint is asked every tenth of
        `health_timeout` (default `stall_timeout`; at most every 30 s), and `health_timeout` seconds without an
        answer is a HANG (stacks, then the group is stopped) — an engine stopped mid-request (SIGSTOP, a
        deadlocked API process) answers nothing. Start-up needs the longer limit (silent imports and loads), a
        serving engine answers its health endpoint within seconds."""
        limit = self.cfg.health_timeout or self.cfg.stall_timeout
        every = min(30.0, max(1.0, limit / 10))
        answered = next_probe = time.monotonic()
        while not stop.wait(0.5):
            self._track_children()
            if self.proc.poll() is not None:
                return self._ended("crashed", f"the engine exited with code {self.proc.returncode} while serving")
            if self.capture_error:
                return self.stop("capture_failed", self.capture_error)
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + every
                if self._healthy(timeout=min(5.0, every)):
                    answered = time.monotonic()
                elif time.monotonic() - answered >= limit:
                    return self._hang(f"GET {self.spec.health_path} unanswered for "
                                      f"{time.monotonic() - answered:.0f} s while serving")
        return self.stop("stopped")

    def stop(self, status: str = "stopped", diagnosis: str = "") -> ServeResult:
        """SIGTERM the group, SIGKILL after the grace period, and confirm nothing of it survives."""
        self._say(f"stopping the engine ({status})")
        survivors = self._kill_group()
        return self._result(status, diagnosis or f"stopped by request during {self.phase}", survivors)

    # ---- internals --------------------------------------------------------------------------------------------

    def _advance(self, phase: str) -> None:
        if ORDER.index(phase) > ORDER.index(self.phase):
            before, self.phase = self.phase, phase
            self._say(f"phase {before} -> {phase}")

    def _foreign_listener(self) -> str:
        """'' when a process of the engine's tree listens on the port (or nobody this user can see does), else the
        one-line reason: another process's server answered /health."""
        holders = listeners(self.cfg.port)
        ours = {p.pid for p in self._alive()}
        if not holders or any(pid in ours for pid in holders) or all(pid is None for pid in holders):
            return ""
        who = ", ".join(describe(pid) for pid in holders if pid is not None)
        return (f"port {self.cfg.port} is answered by {who}, not by the {self.cfg.engine} engine (pid "
                f"{self.proc.pid} and its children): another server holds the port; stop it or choose another --port")

    def _first_request(self) -> None:
        import httpx

        path, body = self.spec.first_request
        try:
            r = httpx.post(self.url + path, json=body, timeout=None)  # the watchdog, not a timeout, bounds it
            self._probe["error"] = "" if r.status_code == 200 else f"HTTP {r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            self._probe["error"] = f"{type(exc).__name__}: {exc}"

    def _say(self, msg: str) -> None:
        if self.cfg.echo:
            print(f"hstap serve [{self.phase}]: {msg}", flush=True)

    def _tee(self) -> None:
        with open(self.log_path, "ab") as log:
            for raw in iter(self.proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip()
                self.last_lines.append(line)
                self._last_output = time.monotonic()
                self._check_hooks(line)  # before the ready line counts: a capture error wins over readiness
                self._check_fusion(line)
                if self.spec.ready_line in line:
                    self._ready_line.set()
                if self.cfg.echo and line:
                    print(f"  {self.cfg.engine}| {line[:240]}", flush=True)
                self._advance(next((p for p, rx in PHASES if rx is not None and rx.search(line)), self.phase))

    def _check_hooks(self, line: str) -> None:
        """A capture hook spec SGLang matched to no module, or to several (it would fire twice per forward)."""
        if self.capture_error:
            return
        if m := CAPTURE_ERROR.search(line):
            self.capture_error = m.group(1)
        elif m := NO_MATCH.search(line):
            self.capture_error = (f"capture hook spec '{m.group(1)}' matched no module of the served model (patterns "
                                  f"{m.group(2)}): its module names differ from hstap/capture/arch.py's row, or the "
                                  "engine built fewer layers than config.json says (--json-model-override-args)")
        elif m := REGISTERED.search(line):
            names = self._hooked.setdefault(m.group(1), set())
            names.add(m.group(2))
            if len(names) > 1:
                self.capture_error = (f"capture hook spec '{m.group(1)}' matched {len(names)} modules "
                                      f"({', '.join(sorted(names))}): it must name exactly one")

    def _check_fusion(self, line: str) -> None:
        """With capture on: an all-reduce fusion SGLang enabled and did not disable on the very next line."""
        if self.cfg.capture_dir is None or self.capture_error:
            return
        if FUSION_OFF.search(line):
            self._fusion = ""
        elif m := FUSION_ON.search(line):
            self._fusion = m.group(1)
        elif self._fusion and line.strip():
            self.capture_error = (f"SGLang enabled its FlashInfer all-reduce fusion for {self._fusion}, which "
                                  "bypasses the input norms the capture hooks read: launch it with "
                                  "--enforce-disable-flashinfer-allreduce-fusion (hstap sglang-flags prints it)")

    def _healthy(self, timeout: float = 5.0) -> bool:
        import httpx

        try:
            return httpx.get(self.url + self.spec.health_path, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _track_children(self) -> None:
        """Remember every descendant ever seen: one that left the process group is still ours to stop."""
        try:
            for child in self._known[self.proc.pid].children(recursive=True):
                self._known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _alive(self) -> list[psutil.Process]:
        alive = []
        for p in self._known.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        return alive

    def _spinning(self) -> str:
        """The busiest process, when the group has burnt at least half a core since the last log output, else ''.
        Averaged over the silent window and summed over the group (spinners sharing a busy machine each get only a
        slice of a core; a group blocked on a lock or a socket uses next to none)."""
        now = time.monotonic()
        if self._cpu_mark[0] < self._last_output:  # new output since the mark: start a new window
            self._cpu_mark = (now, self._cpu_times())
            return ""
        since, before = self._cpu_mark
        if now - since < 1.0:
            return ""
        used = {pid: (cpu - before[pid]) / (now - since) for pid, cpu in self._cpu_times().items() if pid in before}
        if sum(used.values()) < 0.5:  # the group together: spinners sharing a busy machine each get a slice
            return ""
        pid = max(used, key=used.get)
        return f"pid {pid} ({self._known[pid].name()}) and {len(used) - 1} more at {sum(used.values()):.1f} cores"

    def _cpu_times(self) -> dict[int, float]:
        times = {}
        for p in self._alive():
            try:
                t = p.cpu_times()
                times[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return times

    def _dump_stacks(self) -> Path:
        stacks = self.cfg.run_dir / "stacks"
        how = stack_dumps.dump_stacks([p.pid for p in self._alive()], stacks, self.faulthandler_dir)
        self._say("stacks: " + ", ".join(f"{pid} by {way or 'nothing'}" for pid, way in how.items()))
        return stacks

    def _hang(self, why: str, status: str = "hang") -> ServeResult:
        self._track_children()
        stacks = self._dump_stacks()
        self._say(f"HANG: {why}; stacks in {stacks}")
        survivors = self._kill_group()
        return self._result(status, f"{status.upper()} during {self.phase}: {why}", survivors, stacks)

    def _ended(self, status: str, why: str) -> ServeResult:
        survivors = self._kill_group()  # its children may outlive it
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self._result(status, why, survivors)

    def _kill_group(self) -> list[int]:
        self._track_children()
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        self._signal_all(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace_s
        while self._alive() and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.1)
        if self._alive():
            self._signal_all(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self._alive() and time.monotonic() < deadline:
                self.proc.poll()
                time.sleep(0.1)
        self.proc.poll()
        survivors = [p.pid for p in self._alive()]
        if not survivors and self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        return survivors

    def _signal_all(self, pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self._alive():  # descendants that moved to another group
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def _result(self, status: str, why: str, survivors: list[int], stacks: Path | None = None) -> ServeResult:
        code = self.proc.poll()
        stack_dumps.drop_empty(self.faulthandler_dir)
        return ServeResult(status=status, exit_code=code, phase=self.phase, diagnosis=why,
                           last_lines=list(self.last_lines)[-12:], stacks_dir=stacks, survivors=survivors,
                           elapsed_s=time.monotonic() - self._started)


def format_result(r: ServeResult, log: Path) -> str:
    if r.status in ("capture_failed", "port_taken") and not r.survivors:  # the diagnosis says it all: one line
        return f"hstap serve: error: {r.diagnosis}; engine stopped (log: {log})"
    lines = [f"hstap serve: {r.diagnosis}", f"  exit code: {r.exit_code}; phase: {r.phase}; log: {log}"]
    if r.stacks_dir is not None:
        lines.append(f"  Python stacks of every engine process: {r.stacks_dir}")
    if r.survivors:
        lines.append(f"  processes that survived SIGKILL: {r.survivors}")
    if r.last_lines and r.status != "stopped":
        lines.append("  last log lines:")
        lines += [f"    {line}" for line in r.last_lines]
    return "\n".join(lines)


@contextmanager
def served(cfg: ServeConfig) -> Iterator[str]:
    """The engine of `cfg` started and ready, as its URL; stopped with everything it started on the way out,
    whatever happens in between. For a library caller (the recipe's `serve:` synth, bench/engine_speedup.py) what
    `hstap serve` is on the command line: an engine that does not come up (crash, hang, timeout) is an HstapError
    after its last log lines and any hang's stacks are printed."""
    sup = Supervisor(cfg)
    sup.start()
    ended = None
    try:
        ended = sup.wait_ready()
        if ended is not None:  # crashed, hung or timed out: the supervisor has stopped the engine's group already
            print(format_result(ended, sup.log_path), flush=True)
            raise HstapError(f"serve: the {cfg.engine} engine did not come up ({ended.status} during {ended.phase}): "
                             f"{ended.diagnosis}; log: {sup.log_path}")
        yield sup.url
    finally:
        if ended is None:  # ready (or interrupted while waiting): stop it now
            ended = sup.stop()
            if ended.survivors:
                print(f"hstap: processes of the {cfg.engine} engine survived its stop: {ended.survivors}",
                      file=sys.stderr)
