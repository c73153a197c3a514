"""Fault injection for crash tests: a switch the code honours, so a test kills a run at an exact point instead of
racing a timer.

    HSTAP_FAULT=shard-committed:3 hstap capture ...     # SIGKILL itself right after the 3rd shard is committed
    HSTAP_FAULT=record-written:2,shard-committed:1 ...  # several points, each with its own count

Each `fault_point(name)` call counts one pass of that point in this process; on the n-th pass named in
HSTAP_FAULT the process sends itself SIGKILL (no cleanup, no atexit, no flush: what a power cut or the OOM killer
does). Unset, a point costs one dictionary lookup.

Points: `shard-committed` (store writer, after the manifest names a new shard), `shard-renamed` (store writer,
shard file in place, manifest not yet updated), `record-written` (synth, after a whole output line),
`step-done` (train, after an optimizer step), `checkpoint-written` (train, checkpoint files written, not yet
renamed into place).

Points named `hang-…` block forever instead (idle, as a deadlock does: what the supervisor's stall watchdog must
catch), points named `raise-…` raise `InjectedFault` instead; both on the n-th pass, like the others:
`hang-loading`, `hang-warmup`, `hang-first-request` (the `hf` engine's start-up phases: before the model loads,
before its warm-up generation, in its first request), `raise-in-tap` (a capture hook of the `hf` engine, inside
the forward: the guard around the hook must keep the forward and the server going).
"""

from __future__ import annotations

import os
import signal
import time

ENV = "HSTAP_FAULT"
_passes: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """What a `raise-…` point raises."""


def _plan() -> dict[str, int]:
    plan = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, count = item.partition(":")
        plan[name] = int(count) if count.isdigit() else 1
    return plan


def fault_point(name: str) -> None:
    """Count a pass of `name`; on the pass HSTAP_FAULT asks for, SIGKILL this process (or hang, or raise)."""
    if ENV not in os.environ:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _plan().get(name) != _passes[name]:
        return
    if name.startswith("hang-"):
        while True:  # no output, no CPU, no progress: only a watchdog outside ends this
            time.sleep(3600)
    if name.startswith("raise-"):
        raise InjectedFault(f"{ENV} {name}:{_passes[name]}")
    os.kill(os.getpid(), signal.SIGKILL)
