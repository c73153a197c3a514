"""The learning-rate schedule and `--time-budget`: a budgeted run is fitted to its wall time before step 1, then
re-fitted to the steps it really takes.

    hstap train --store runs/cap --out runs/drafter --time-budget 10m

Before step 1 a probe times a few steps (`seconds_per_step`) and the schedule is fitted to the steps that fit the
budget (`fit_to_budget`), so the run warms up and decays fully instead of being cut off mid-schedule. A probe's
steps are not the run's (a new sequence length recompiles a kernel or captures a graph in the probe; later steps
reuse it), so every REFIT_EVERY steps and at each epoch end the count is fitted again to the steps timed so far,
the held-out evaluations still to come taken out of the budget (`Budget.refit`).

A resumed budgeted run keeps refitting: its checkpoint records the budget seconds its steps had taken
(`WarmupCosine.spent`), and the rest of the run is fitted to what is left. A run killed 250 steps into a 7-minute
budget had been fitted to its first, compiling steps (0.25 s each, later 0.12); had the resume kept that count
frozen it would have stopped a third of the way into the budget.
"""

from __future__ import annotations

import math
import time

import torch

from hstap.train import distributed
from hstap.train.data import BatchSource, SampleSource, load_batch
from hstap.train.graphed import GraphedTTT
from hstap.train.ttt import batch_tensors


class WarmupCosine:
    """Linear warmup, then cosine to zero at `total` steps.

    A callable object rather than a closure because LambdaLR checkpoints an object's attributes: a run fitted
    to a time budget resumes with the fitted schedule, not a new fit."""

    def __init__(self, total: int, warmup_ratio: float):
        self.total = total
        self.warmup_ratio = warmup_ratio
        self.fitted = False  # the time budget has been applied
        self.spent = 0.0  # budget seconds the checkpointed steps took: a resumed run fits the rest into what is left
        self.per_step = 0.0  # the last fit's seconds per step: a resumed run's first fit, before it times its own

    def __call__(self, step: int) -> float:
        warmup = max(1, int(self.total * self.warmup_ratio))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


PROBE_SKIP, PROBE_STEPS = 3, 10  # steps ignored (allocator, kernels warming up), then steps timed
REFIT_EVERY = 50  # a budgeted run re-fits its step count to the steps it has timed this often (and at epoch ends)


def probe_sizes(batches: int) -> tuple[int, int]:
    """(untimed, timed) probe steps for a plan of `batches` batches: PROBE_SKIP + PROBE_STEPS, but never more
    than the plan's own batches, plus one untimed warm-up — a tiny run must not spend most of its time probing."""
    if batches >= PROBE_SKIP + PROBE_STEPS:
        return PROBE_SKIP, PROBE_STEPS
    return 1, max(1, batches)


def seconds_per_step(model: torch.nn.Module, source: SampleSource | BatchSource, batches: list[list[int]],
                     layer_ids: list[int], device: torch.device, autocast, graphed: GraphedTTT | None = None) -> float:
    """Wall time of one training step (fetch, forward, backward) on the first batches of the plan, measured before
    training so the schedule is fitted before step 1. No optimizer step: weights and optimizer state stay as
    they are, and the measured batches are trained on again in order."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed_from = 0.0
    skip, timed = probe_sizes(len(batches))
    for n, indices in enumerate((batches * (skip + timed))[:skip + timed]):
        if n == skip:
            sync()
            timed_from = time.perf_counter()
        batch = load_batch(source, indices, layer_ids, device)
        if graphed is not None:  # a length bucket first met here is captured here: the run's refits correct for it
            graphed(batch, autocast)
        else:
            with autocast:
                loss = model(*batch_tensors(batch))[0]
            loss.backward()
        model.zero_grad(set_to_none=graphed is None)  # a graph's gradients stay where it writes them
    sync()
    return (time.perf_counter() - timed_from) / timed


def fit_to_budget(total: int, step: int, seconds_per_step: float, seconds_left: float) -> int:
    """The step count that ends the run about when the budget does. The LR schedule is fitted to it before step 1,
    so a budgeted run warms up and decays fully instead of being cut off mid-schedule. The run then re-fits it to
    the steps it has really timed, held-out evaluations included (`refit_to_budget`)."""
    if step >= total:
        return total  # nothing left to fit: a finished run stays finished
    return max(step + 1, min(total, step + int(seconds_left / seconds_per_step)))


def refit_to_budget(cap: int, step: int, seconds_per_step: float, seconds_left: float, eval_seconds: float,
                    steps_per_epoch: int, step_in_epoch: int) -> int:
    """`fit_to_budget` again mid-run, from the steps really timed so far instead of the probe's (the probe's few
    steps pay one-off costs, a kernel compiled or a graph captured for each new length, that later steps do not:
    a probe that timed 0.7 s a step for steps that then took 0.2 would spend under a third of the budget), and with
    the held-out evaluations still to come, `eval_seconds` each (the epoch ends ahead, and the one at a mid-epoch
    stop), taken out of the budget. Never past `cap` (the run's own end); `step` itself when the budget is spent
    (unlike the first fit, a refit may stop the run now)."""
    def fit(seconds: float) -> int:
        return max(step, min(cap, step + int(seconds / seconds_per_step)))

    total = fit(seconds_left)
    for _ in range(2):  # the evaluations depend on where the run ends, which depends on them: two passes settle it
        evals = -(-(step_in_epoch + total - step) // max(1, steps_per_epoch))  # epoch ends ahead, + a mid-epoch stop
        total = fit(seconds_left - evals * eval_seconds)
    return total


class Budget:
    """A budgeted run's clocks: when it started, when its timed steps started, how long its evaluations took.

    Every figure a fit reads is agreed over the ranks (the slowest's), so under torchrun all ranks fit the same
    step count and stop after the same step."""

    def __init__(self, seconds: float | None, schedule: WarmupCosine, dist: distributed.Dist, start: float,
                 first_step: int, steps_per_epoch: int, eval_seconds: float, cap: int):
        self.seconds = seconds
        self.active = bool(seconds)
        self.needs_first_fit = self.active and not schedule.fitted  # a resumed run refits from its own steps
        self.dist = dist
        self.cap = cap  # the run's own end (--epochs, --max-steps): no fit goes past it
        # a resumed run's budget clock goes on from the seconds its checkpointed steps took
        self.start = start - (schedule.spent if schedule.fitted else 0.0)
        self.steps_from = start
        self.first_step = first_step
        self.steps_per_epoch = steps_per_epoch
        self.eval_seconds = eval_seconds  # the last held-out evaluation's wall time
        self.evals_took = 0.0  # of the time since steps_from, the epoch-end evaluations'

    def first_fit(self, total: int, step: int, seconds_per_step: float) -> int:
        """The step count that a step of `seconds_per_step` (the probe's, agreed over the ranks) fits into what
        is left of the budget."""
        return fit_to_budget(total, step, seconds_per_step,
                             self.seconds - self.dist.agree_max(time.perf_counter() - self.start))

    def elapsed(self) -> float:
        """Budget seconds spent so far, the checkpointed steps of earlier runs of this one included."""
        return time.perf_counter() - self.start

    def steps_start(self) -> None:
        """Training steps start now: a refit times steps from here, not the probe before them."""
        self.steps_from = time.perf_counter()

    def evaluated(self, seconds: float) -> None:
        """An epoch-end evaluation took `seconds`: out of the steps' time, and the cost of each one still ahead."""
        self.eval_seconds = seconds
        self.evals_took += seconds

    def refit_due(self, step: int, total: int) -> bool:
        return self.active and (step - self.first_step) % REFIT_EVERY == 0 and step < total

    def refit(self, total: int, step: int, step_in_epoch: int) -> tuple[int, float]:
        """(the step count, the seconds a step took) from the steps timed so far; `total` before any step."""
        if step == self.first_step:
            return total, 0.0
        evals = self.dist.agree_max(self.evals_took)  # rank 0 evaluates; the others wait for it at a collective
        per_step = self.dist.agree_max((time.perf_counter() - self.steps_from - evals) / (step - self.first_step))
        left = self.seconds - self.dist.agree_max(time.perf_counter() - self.start)  # ranks started apart: agreed
        fitted = refit_to_budget(self.cap, step, per_step, left, self.dist.agree_max(self.eval_seconds),
                                 self.steps_per_epoch, step_in_epoch)
        return fitted, per_step
