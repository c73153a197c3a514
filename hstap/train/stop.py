"""How `hstap train` stops without losing a step: on SIGTERM or SIGINT it writes the checkpoint of the step it is
on, then exits 143 (SIGTERM) or 130 (SIGINT); `--resume` continues from that step.

    with TrainStop() as stop:
        ...                              # model load, first evaluation: a signal stops at once (no step to keep)
        stop.defer()                     # the training loop: a signal is only recorded ...
        code = vote(stop.code(due))      # ... every rank learns it through the checkpoint vote (LateVote) ...
        if code == STOP: checkpoint.save(...); stop.raise_stopped(...)   # ... and all save the same step, then stop

Schedulers, containers and `timeout` send SIGTERM; it is handled exactly like Ctrl-C, as `hstap capture` handles
both (hstap.capture.stop). Neither raises inside a step: the step in flight finishes, its checkpoint is written,
then the run stops. A second signal stops at once (the last checkpoint is whole either way).

Under torchrun the scheduler's SIGTERM reaches every rank at slightly different moments (or only one, killed by
hand). A rank that stopped alone would leave the others waiting in the next all-reduce, so the stop rides on the
vote the ranks already take after every step on whether a checkpoint is due: its value is the largest of every
rank's code (0 go on, CHECKPOINT, STOP), learned one step late, the same on every rank at the same step.
"""

from __future__ import annotations

import signal

from hstap.errors import Interrupted
from hstap.signals import DeferredStop

CHECKPOINT, STOP = 1, 2  # vote codes: a checkpoint is due on some rank; some rank was signalled (checkpoint, stop)


class TrainStop(DeferredStop):
    """SIGINT/SIGTERM handlers for the duration of a `with` (hstap.signals): once deferred, the loop stops after
    the step in flight, its checkpoint written."""

    command = "hstap train"
    notice = "stopping after this step and writing its checkpoint"

    def defer(self, on: bool = True) -> None:
        """From now on (`on`) the first signal is only recorded: the loop stops after the step in flight, its
        checkpoint written. `on=False`: a signal stops at once again (once the last checkpoint holds every step)."""
        self._deferring = on
        if not on and self.signum is not None:
            self.raise_stopped("the checkpoint holds every step")

    def code(self, checkpoint_due: bool) -> int:
        """This rank's vote after a step: STOP when signalled, CHECKPOINT when its clock says one is due."""
        return STOP if self.signum is not None else CHECKPOINT if checkpoint_due else 0

    def agreed(self, code: int) -> None:
        """The vote came back STOP: a rank that got no signal itself stops as SIGTERM would stop it."""
        if code >= STOP and self.signum is None:
            self.signum = int(signal.SIGTERM)

    def raise_stopped(self, message: str) -> None:
        """Raise Interrupted for the signal received (the CLI prints `message`, exits 128 + signum)."""
        signum = self.signum or signal.SIGTERM
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}: {message}")
