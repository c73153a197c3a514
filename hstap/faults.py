"""Fault injection for crash tests: a switch the code honours, so a test kills a run at an exact point instead of
racing a timer.

    HSTAP_FAULT=shard-committed:3 hstap capture ...     # SIGKILL itself right after the 3rd shard is committed
    HSTAP_FAULT=record-written:2,shard-committed:1 ...  # several points, each with its own count
    HSTAP_FAULT=record-write:3:enospc hstap synth ...   # the 3rd pass raises OSError(ENOSPC): a full disk

Each `fault_point(name)` call counts one pass of that point in this process; on the n-th pass named in
HSTAP_FAULT the process sends itself SIGKILL (no cleanup, no atexit, no flush: what a power cut or the OOM killer
does), or with a third field `enospc` raises `OSError(errno.ENOSPC)` there, as a write to a full disk does.
Unset, a point costs one dictionary lookup.

Points: `shard-committed` (store writer, after the manifest names a new shard), `shard-renamed` (store writer,
shard file in place, manifest not yet updated), `record-write` (synth/prompts, before a whole output line is
written), `record-written` (synth/prompts, after a whole output line), `model-load` (any command, target weights
read, tokenizer not yet), `decode-step` (runtime decode loop, after each new token of a batch: mid-batch in synth),
`train-batch` (train, after a batch's backward, before the optimizer step), `step-done` (train, after an optimizer
step), `checkpoint-write` (train, temp checkpoint directory made, files not yet written), `checkpoint-written`
(train, checkpoint files written, not yet renamed into place).
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "HSTAP_FAULT"
_passes: dict[str, int] = {}


def _plan() -> dict[str, tuple[int, str]]:
    plan = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, rest = item.partition(":")
        count, _, action = rest.partition(":")
        plan[name] = (int(count) if count.isdigit() else 1, action or "kill")
    return plan


def fault_point(name: str) -> None:
    """Count a pass of `name`; on the pass HSTAP_FAULT asks for, SIGKILL this process (or raise ENOSPC)."""
    if ENV not in os.environ:
        return
    _passes[name] = _passes.get(name, 0) + 1
    count, action = _plan().get(name, (0, "kill"))
    if count != _passes[name]:
        return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (HSTAP_FAULT {name}:{count}:enospc)")
    os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Forget the passes counted so far (in-process tests that set HSTAP_FAULT more than once)."""
    _passes.clear()
