"""Fault injection for crash tests: a switch the code honours, so a test kills a run at an exact point instead of
racing a timer.

    HSTAP_FAULT=shard-committed:3 hstap capture ...     # SIGKILL itself right after the 3rd shard is committed
    HSTAP_FAULT=record-written:2,shard-committed:1 ...  # several points, each with its own count
    HSTAP_FAULT=batch-forwarded:2:TERM hstap capture    # send itself SIGTERM after the 2nd batch (a scheduler's stop)
    HSTAP_FAULT=shard-write:1:ENOSPC hstap capture      # the 1st shard write fails as on a full disk
    HSTAP_FAULT=record-write:3:enospc hstap synth ...   # the 3rd pass raises OSError(ENOSPC) (actions in any case)

Each `fault_point(name)` call counts one pass of that point in this process; on the n-th pass named in
HSTAP_FAULT (`name[:count[:action]]`, count 1 by default) the action runs:
- `KILL` (default): SIGKILL itself (no cleanup, no atexit, no flush: what a power cut or the OOM killer does);
- `TERM`, `INT`: send itself SIGTERM / SIGINT (a scheduler, `timeout`, Ctrl-C), then carry on as the handler says;
- `STOP`: SIGSTOP itself, so a test can act while the process holds its locks and resume it with SIGCONT;
- `ENOSPC`: raise OSError(ENOSPC) right there, as a write to a full disk does.
Unset, a point costs one dictionary lookup.

Points: `shard-committed` (store writer, after the manifest names a new shard), `shard-renamed` (store writer,
shard file in place, manifest not yet updated), `shard-write` (store writer, half of a shard's bytes in its `.tmp`),
`manifest-write` (store writer, half of a manifest's bytes in its `.tmp`), `sample-buffered` (store writer, a
sample copied into the buffer), `capture-checked` (capture: store locked, layers and disk checked, model not yet
loaded), `model-loaded` (capture), `batch-forwarded` (capture, a batch's forward done and handed to the tap), `batch-stored` (capture, the tap's
writer thread: every sample of a batch in the store writer and the `--commit-every` commit made if it was due),
`batch-followed` (capture, a tensor-parallel rank other than 0 done with a batch's forward),
`record-write` (synth/prompts, before a whole output line is written), `record-written` (synth/prompts, after a
whole output line), `model-load` (any command, target weights read, tokenizer not yet), `decode-step` (runtime
decode loop, after each new token of a batch: mid-batch in synth), `train-batch` (train, after a batch's backward,
before the optimizer step), `step-done` (train, after an optimizer step), `checkpoint-write` (train, temp
checkpoint directory made, files not yet written), `checkpoint-written` (train, checkpoint files written, not yet
renamed into place), `merge-shard` (store merge, after each shard is linked or copied into place),
`merge-manifest` (store merge, the merged manifest written, the merge's plan file not yet removed).

Points named `hang-…` block forever instead (idle, as a deadlock does: what the supervisor's stall watchdog must
catch), points named `raise-…` raise `InjectedFault` instead; both on the n-th pass, like the others:
`hang-loading`, `hang-warmup`, `hang-first-request` (the `hf` engine's start-up phases: before the model loads,
before its warm-up generation, in its first request), `raise-in-tap` (a capture hook of the `hf` engine, inside
the forward: the guard around the hook must keep the forward and the server going).
"""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "HSTAP_FAULT"
ACTIONS = ("KILL", "TERM", "INT", "STOP", "ENOSPC")
_passes: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """What a `raise-…` point raises."""


def _plan() -> dict[str, tuple[int, str]]:
    plan = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, rest = item.partition(":")
        count, _, action = rest.partition(":")
        action = action.upper() or "KILL"
        if action not in ACTIONS:
            raise ValueError(f"{ENV}={item!r}: unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
        plan[name] = (int(count) if count.isdigit() else 1, action)
    return plan


def fault_point(name: str) -> None:
    """Count a pass of `name`; on the pass HSTAP_FAULT names, run its action (hang or raise for `hang-…` and
    `raise-…` points)."""
    if ENV not in os.environ:
        return
    _passes[name] = _passes.get(name, 0) + 1
    count, action = _plan().get(name, (0, ""))
    if count != _passes[name]:
        return
    if name.startswith("hang-"):
        while True:  # no output, no CPU, no progress: only a watchdog outside ends this
            time.sleep(3600)
    if name.startswith("raise-"):
        raise InjectedFault(f"{ENV} {name}:{_passes[name]}")
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # word for word what a full disk says
    os.kill(os.getpid(), getattr(signal, "SIG" + action))


def reset() -> None:
    """Forget the passes counted so far (tests that inject faults in-process, one run after another)."""
    _passes.clear()
