"""The training loop of `hstap train`: hstap.train.run loads the target, the samples and the drafter, then

    trainer = Trainer(cfg, dist, target, source, layer_ids, drafter, train_idx, held_idx)
    done = trainer.open_run(changed, cleanup)  # a fresh run directory, or its checkpoint resumed (done: nothing left)
    trainer.start(progress)                    # the untrained drafter evaluated, a time budget fitted
    trainer.train(stop)                        # steps, checkpoints, an evaluation at each epoch end
    result = trainer.finish(stop)              # the last checkpoint, the final evaluation, the drafter written

A step reads nothing back from the device: its loss and gradient norm are logged a step later (StepLog), and
whether a checkpoint is due, or a signal stops the run, is a vote of every rank learned a step later (LateVote), so
all ranks save, and stop after, the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hstap.drafter import Eagle3Drafter, target_to_draft_ids
from hstap.errors import HstapError
from hstap.faults import fault_point
from hstap.metrics import tokens_per_second
from hstap.progress import progress_bar
from hstap.train import budget, checkpoint, distributed, resume, rundir
from hstap.train.calibrate import calibrate, calibration_indices, prompt_of
from hstap.train.config import TrainConfig
from hstap.train.data import BatchSource, SampleSource, StoreSource, load_batch, plan_batches
from hstap.train.gradsync import FlatGradients
from hstap.train.graphed import GraphedTTT
from hstap.train.heldout import evaluate_heldout, replayed_first_answers
from hstap.train.steplog import StepLog
from hstap.train.stop import STOP, TrainStop
from hstap.train.ttt import TTTModel, batch_tensors
from hstap.train.ttt import autocast as ttt_autocast


@dataclass
class TrainResult:
    out: Path
    steps: int
    train_tokens: int
    seconds: float
    heldout: dict  # last held-out evaluation
    initial_heldout: dict  # the untrained drafter on the same split
    drafter: Eagle3Drafter | None = None  # the trained model, in memory (each rank's copy under DDP)
    already_finished: bool = False  # `--resume` of a run that had nothing left to do: nothing was written

    def summary(self) -> str:
        if self.already_finished:
            return (f"hstap train: the run in {self.out} already finished at step {self.steps}; nothing to do, nothing "
                    f"written (its drafter: {self.out / 'model.safetensors'}); a larger --epochs or --max-steps "
                    "trains on")
        h, h0 = self.heldout, self.initial_heldout
        tau = ", ".join(f"{d}:{v:.2f}" for d, v in h.get("tau_est", {}).items())
        lines = [f"trained {self.steps} steps on {self.train_tokens} tokens "
                 f"({tokens_per_second(self.train_tokens, self.seconds):.0f} tok/s) → {self.out}",
                 f"held-out loss {h0.get('loss', float('nan')):.3f} → {h.get('loss', float('nan')):.3f}; "
                 f"step-0 top-1 {h0.get('acc', [0])[0]:.3f} → {h.get('acc', [0])[0]:.3f}; "
                 f"estimated τ by chain length {{{tau}}}" if h else
                 "held-out: none (no sample was held out: raise --heldout or train on more samples)"]
        c = h.get("calibration")
        if c:
            lines.append(f"measured τ (chain {c['chain']}, {c['prompts']} held-out prompts, {c['tokens']} tokens) "
                         f"{c['tau_measured']:.2f} vs estimated {c['tau_est']:.2f}: gap {c['gap']:+.2f}; estimated on "
                         f"the same answers and tokens {c.get('tau_est_same', float('nan')):.2f}: gap "
                         f"{c.get('gap_same', float('nan')):+.2f}")
        return "\n".join(lines)


class Trainer:
    """One run's optimizer, schedule, run directory and clocks around a built drafter (see the module)."""

    def __init__(self, cfg: TrainConfig, dist: distributed.Dist, target, source: SampleSource | BatchSource,
                 layer_ids: list[int], drafter: Eagle3Drafter, train_idx: list[int], held_idx: list[int]):
        # train_config.json records the sizes the drafter was built with
        self.cfg = cfg = cfg.model_copy(update={"draft_vocab": drafter.config.draft_vocab_size,
                                                "draft_intermediate": drafter.config.intermediate_size})
        self.dist, self.device, self.target, self.source = dist, dist.device, target, source
        self.layer_ids, self.drafter, self.train_idx, self.held_idx = layer_ids, drafter, train_idx, held_idx
        self.out = Path(cfg.out)
        self.t2d_ids = target_to_draft_ids(drafter.d2t, drafter.config.vocab_size).to(self.device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                           fused=self.device.type == "cuda")  # one kernel for all parameters
        self.batches_per_step = dist.world_size * cfg.grad_accum  # batches in one optimizer step, all ranks together
        self.steps_per_epoch = len(self.epoch_plan(0)) // self.batches_per_step
        self.planned_steps = cfg.max_steps or self.steps_per_epoch * cfg.epochs  # before a time budget fits it
        self.schedule = budget.WarmupCosine(self.planned_steps, cfg.warmup_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        model = TTTModel(drafter, self.t2d_ids, cfg.ttt_steps, cfg.decay, cfg.ttt_attention, cfg.loss_on)
        # several ranks: DDP's hooks all-reduce during the backward, or one flat all-reduce after it (--grad-reduce)
        bf16_wire = cfg.grad_reduce_dtype == "bf16"
        self.flat = FlatGradients(self.params, dist, torch.bfloat16 if bf16_wire else None) \
            if dist.enabled and cfg.reduce_after else None
        self.model = model if self.flat is not None else dist.wrap(model, bf16_gradients=bf16_wire)
        self.graphed = GraphedTTT(self.model, 1 / cfg.grad_accum, cfg.batch_tokens) if cfg.cuda_graphs else None
        self.keep_grads = self.graphed is not None or self.flat is not None  # what graphs or the flat buffer write
        self.autocast = ttt_autocast(self.device)
        self.state = checkpoint.State(batches_per_step=self.batches_per_step)

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        return plan_batches(self.train_idx, self.source.lengths, self.cfg.batch_tokens, self.cfg.seed, epoch,
                            self.batches_per_step)

    # -- the run directory ------------------------------------------------------------------------------------------

    def open_run(self, changed: dict[str, tuple], cleanup: rundir.EarlyFailureCleanup) -> TrainResult | None:
        """A fresh run directory, or the checkpoint in it resumed; the result to return at once when a resumed run
        has nothing left to do. `changed`: the --epochs/--max-steps a resume changes (hstap.train.resume)."""
        if self.cfg.resume:
            if (finished := self._resume()) is not None:
                return finished
        elif self.dist.rank == 0:
            self._start_fresh(cleanup)
        self.log = checkpoint.MetricsLog(self.out / "metrics.jsonl", enabled=self.dist.rank == 0,
                                         tensorboard=self.out / "tb",
                                         purge_step=self.state.step if self.cfg.resume else None)
        if changed:
            self.log.write({"kind": "resume", "step": self.state.step, "total_steps": self.schedule.total,
                            "changed": {name: list(pair) for name, pair in changed.items()}})
        self.calib_idx = calibration_indices(self.source, self.held_idx, self.cfg.calib_prompts) \
            if self.dist.rank == 0 else []
        self.prompts = [prompt_of(self.source, i) for i in self.calib_idx]
        return None

    def _resume(self) -> TrainResult | None:
        cfg, out, dist = self.cfg, self.out, self.dist
        self.state = state = checkpoint.load(out, self.drafter, self.optimizer, self.scheduler)
        if state.batches_per_step != self.batches_per_step:
            raise HstapError(f"--resume: the checkpoint in {out} took {state.batches_per_step} batches per step "
                             f"(ranks × --grad-accum), this run takes {self.batches_per_step} ({dist.world_size} × "
                             f"{cfg.grad_accum}): set --grad-accum so the global batch is the same")
        if not self.schedule.fitted:  # --epochs/--max-steps as this command gives them (resume.py: the rule)
            resume.reschedule(self.schedule, self.scheduler, self.planned_steps)
        trained_out = state.step >= self.schedule.total or state.epoch >= cfg.epochs
        if trained_out and resume.drafter_written_at(out, state.step):  # finished, its drafter written: nothing to do
            return TrainResult(out, state.step, state.train_tokens, 0.0, {}, state.initial_heldout,
                               already_finished=True)
        if dist.rank == 0:
            checkpoint.cut_to(out, state.step)
            resume.write_config(out, resume.as_recorded(out, cfg))  # the flags it runs with now, --max-steps included
        return None

    def _start_fresh(self, cleanup: rundir.EarlyFailureCleanup) -> None:
        cleanup.wrote = True  # from here the files in --out are this run's: removed if it fails before a checkpoint
        if self.cfg.overwrite:
            rundir.clear_run(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        resume.write_config(self.out, self.cfg)
        self.drafter.config.save(self.out / "config.json")
        (self.out / "metrics.jsonl").write_text("")

    # -- evaluation -------------------------------------------------------------------------------------------------

    def evaluate(self, calibrated: bool = True) -> dict:
        """Held-out metrics, and τ measured on the calibration prompts next to the estimate (rank 0 only)."""
        cfg = self.cfg
        result = evaluate_heldout(self.drafter, self.source, self.held_idx, self.layer_ids, self.t2d_ids, cfg,
                                  self.device)
        if calibrated and self.prompts:
            chain = min(cfg.calib_chain, cfg.ttt_steps)
            same = replayed_first_answers(self.drafter, self.source, self.calib_idx, self.layer_ids, self.t2d_ids,
                                          cfg, self.device, chain, cfg.calib_tokens)
            result["calibration"] = calibrate(self.target, self.drafter, self.prompts, chain, cfg.calib_tokens,
                                              result.get("tau_est", {}), same)
        return result

    def log_eval(self, result: dict) -> None:
        self.log.write({"kind": "eval", "epoch": self.state.epoch, "step": self.state.step, **result})
        self.log.flush()  # a TensorBoard watching the run sees every evaluation as it lands

    # -- training ---------------------------------------------------------------------------------------------------

    def start(self, progress: bool) -> None:
        """The untrained drafter's evaluation (a resumed run's was logged before), the progress bar, the clocks, and a
        time budget's fit before step 1."""
        state, rank = self.state, self.dist.rank
        eval_started = time.perf_counter()
        self.initial = state.initial_heldout or (self.evaluate(calibrated=False) if rank == 0 else {})
        eval_seconds = time.perf_counter() - eval_started  # the last held-out evaluation's wall time (a refit's)
        if not state.initial_heldout and rank == 0:
            self.log_eval(self.initial)
        state.initial_heldout = self.last_eval = self.initial
        self.bar = progress_bar(total=self.schedule.total, initial=state.step, desc="train", unit="step",
                                disable=not progress or bool(rank))
        self.steplog = StepLog(self.log.write, self.bar)
        # a store's next batch is read on a host thread while a GPU trains; on a CPU the host is the device, and the
        # read only competes with the step's own threads for the cores: there only when asked
        self.read_ahead = self.cfg.prefetch or (isinstance(self.source, StoreSource) and self.device.type == "cuda")
        self.started, self.tokens_this_run, self.first_step = time.perf_counter(), 0, state.step
        self.time_budget = budget.Budget(self.cfg.time_budget_s, self.schedule, self.dist, self.started, state.step,
                                         self.steps_per_epoch, eval_seconds, cap=self.planned_steps)
        if self.time_budget.needs_first_fit:
            self._fit_budget()
        elif self.time_budget.active and self.schedule.per_step:  # resumed: the rest into what is left
            self._set_total(self.time_budget.first_fit(self.planned_steps, state.step, self.schedule.per_step))
            self.log.write({"kind": "budget_resumed", "step": state.step, "spent_s": round(self.schedule.spent, 3),
                            "total_steps": self.schedule.total})
        self.due = rundir.CheckpointClock(self.cfg.checkpoint_every, self.cfg.checkpoint_interval_s)
        self.time_vote = distributed.LateVote(self.dist)  # no per-step wait on the device for it
        self.time_budget.steps_start()  # the early estimate times training steps only (not the budget probe)

    def _fit_budget(self) -> None:
        """Time a few steps (budget.seconds_per_step) and fit the schedule to the budget before step 1."""
        state, dist = self.state, self.dist
        mine = self.epoch_plan(state.epoch)[dist.rank::dist.world_size]
        seconds = self.cfg.grad_accum * dist.agree_max(budget.seconds_per_step(
            self.model, self.source, mine, self.layer_ids, self.device, self.autocast, self.graphed))
        self._set_total(self.time_budget.first_fit(self.schedule.total, state.step, seconds))
        self.schedule.per_step = seconds
        self.schedule.fitted = True  # every rank agreed on the per-step and elapsed times: they stop at the same step
        self.log.write({"kind": "budget", "step": state.step, "seconds_per_step": seconds,
                        "total_steps": self.schedule.total, "probe_steps": sum(budget.probe_sizes(len(mine)))})

    def _note_budget_spent(self) -> None:
        """The budget seconds spent so far go into the checkpoint with the schedule (a resume fits what is left)."""
        if self.time_budget.active:
            self.schedule.spent = self.dist.agree_max(self.time_budget.elapsed())

    def _set_total(self, total: int) -> None:
        self.schedule.total = total
        self.bar.total = total
        self.bar.refresh()

    def train(self, stop: TrainStop) -> None:
        """Steps until the schedule's end or the last epoch's; a signal stops it after the step in flight."""
        state = self.state
        stop.defer()  # from here a signal ends the loop after the step in flight, its checkpoint written
        while state.step < self.schedule.total and state.epoch < self.cfg.epochs:
            plan = self.epoch_plan(state.epoch)
            steps_in_epoch = len(plan) // self.batches_per_step
            while state.step_in_epoch < steps_in_epoch and state.step < self.schedule.total:
                self.step(plan)
                self._after_step(stop)
            if state.step_in_epoch >= steps_in_epoch:
                self._end_epoch()

    def step(self, plan: list[list[int]]) -> None:
        """One optimizer step over the plan's next batches of every rank; its numbers are logged a step later."""
        cfg, state = self.cfg, self.state
        mine, ahead = step_batches(plan, state.step_in_epoch, cfg.grad_accum, self.dist,
                                   prefetch=self.read_ahead and state.step + 1 < self.schedule.total)
        loss, step_losses = accumulate(self.model, self.source, mine, self.layer_ids, self.device, self.autocast,
                                       self.dist, ahead, self.graphed)
        if self.flat is not None:
            self.flat.average()  # every rank's gradients averaged, as DDP's backward would have left them
        tokens = step_tokens(plan, state.step_in_epoch, self.batches_per_step, self.source.lengths)  # every rank's
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)  # on the device: nothing read back
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)  # zeroed in place where graphs or views add into them
        self.scheduler.step()
        state.step += 1
        state.step_in_epoch += 1
        state.train_tokens += tokens
        self.tokens_this_run += tokens
        rate = tokens_per_second(self.tokens_this_run, time.perf_counter() - self.started)
        record = {"kind": "train", "step": state.step, "epoch": state.epoch, "tokens": state.train_tokens,
                  "loss": None, "step_losses": None, "lr": self.scheduler.get_last_lr()[0], "grad_norm": None,
                  "tokens_per_s": rate}  # the numbers the device holds are filled in a step later
        self.steplog.hold(record, loss, grad_norm, step_losses)
        self.bar.update(1)

    def _after_step(self, stop: TrainStop) -> None:
        """The early time estimate, a checkpoint when due (and the stop a signal asked for), a budget's refit."""
        state = self.state
        if state.step - self.first_step == ETA_AFTER_STEPS and self.dist.rank == 0:
            say_how_long(self.cfg, time.perf_counter() - self.time_budget.steps_from, ETA_AFTER_STEPS,
                         self.schedule.total - state.step)
        # ranks' clocks differ: any rank's clock due, all save (learned a step late on several ranks); a signal to
        # any rank rides on the same vote, so all stop after the same step (hstap.train.stop)
        vote = self.time_vote(stop.code(self.due.by_time()))
        stop.agreed(vote)
        if self.due.by_steps(state.step) or vote:
            self.steplog.flush()  # the metrics hold every step the checkpoint does; a NaN step stops the run here
            self._note_budget_spent()
            checkpoint.save(self.out, self.drafter, self.optimizer, self.scheduler, state, self.dist)
            self.due.saved()
            self.time_vote.clear()
            if vote >= STOP:
                self.log.close()
                stop.raise_stopped(f"the checkpoint of step {state.step} is written in {self.out}; run the same "
                                   "command with --resume to continue from it")
        fault_point("step-done")  # HSTAP_FAULT=step-done:N: a preemption right after step N
        if self.time_budget.refit_due(state.step, self.schedule.total):
            self._refit()

    def _end_epoch(self) -> None:
        """The epoch's held-out evaluation (rank 0), then a budget's refit with its cost known."""
        state = self.state
        state.epoch += 1
        state.step_in_epoch = 0
        self.steplog.flush()  # the epoch's last step before its evaluation
        if self.dist.rank == 0:
            eval_started = time.perf_counter()
            self.last_eval = self.evaluate()
            self.log_eval(self.last_eval)
            self.time_budget.evaluated(time.perf_counter() - eval_started)
        if self.time_budget.active and state.step < self.schedule.total:
            self._refit()

    def _refit(self) -> None:
        fitted, per_step = self.time_budget.refit(self.schedule.total, self.state.step, self.state.step_in_epoch)
        self.schedule.per_step = per_step or self.schedule.per_step
        if fitted != self.schedule.total:
            self.log.write({"kind": "budget_refit", "step": self.state.step, "seconds_per_step": per_step,
                            "total_steps": fitted})
            self._set_total(fitted)

    # -- the end ----------------------------------------------------------------------------------------------------

    def finish(self, stop: TrainStop) -> TrainResult:
        """The last step's checkpoint, the final evaluation, the drafter written (rank 0)."""
        state, dist, out = self.state, self.dist, self.out
        self.steplog.flush()
        self.bar.close()
        # the last step's checkpoint before the final evaluation: a stop or a crash during it (or during the
        # drafter's write) loses no step; the resume evaluates and writes the drafter without training
        self._note_budget_spent()
        checkpoint.save(out, self.drafter, self.optimizer, self.scheduler, state, dist)
        stop.agreed(STOP if dist.agree_max(float(stop.signum is not None)) else 0)
        if stop.signum is not None:  # it came after the last step's vote: the checkpoint just written holds that step
            self.log.close()
            stop.raise_stopped(f"the checkpoint of step {state.step}, the run's last, is written in {out}; run the "
                               "same command with --resume to evaluate it and write the drafter")
        stop.defer(False)  # a signal from here stops at once: the checkpoint holds every step
        self._final_eval()
        self.log.close()
        error = rundir.save_final(self.drafter, out, state.step) if dist.rank == 0 else None
        if dist.agree_max(float(error is not None)):  # also the barrier: no rank waits on a rank 0 that failed
            raise HstapError(error or "rank 0 could not write the trained drafter")
        return TrainResult(out, state.step, state.train_tokens, time.perf_counter() - self.started, self.last_eval,
                           self.initial, self.drafter)

    def _final_eval(self) -> None:
        state = self.state
        # nothing trained (killed after the last checkpoint, before its drafter was written): evaluated already?
        logged = resume.logged_eval(self.out, state.step) \
            if state.step == self.first_step and self.cfg.resume and self.dist.rank == 0 else None
        if logged is not None:
            self.last_eval = logged
        # a run that stops mid-epoch (a step or time budget) is judged where it stopped, not at its last epoch's end
        elif self.dist.rank == 0 and (self.last_eval is self.initial or state.step_in_epoch > 0):
            self.last_eval = self.evaluate()
            self.log_eval(self.last_eval)
            checkpoint.cover_metrics(self.out)  # an extension of this run (--resume --epochs N) keeps this evaluation


ETA_AFTER_STEPS = 3  # steps timed before the run says how long it will take
LONG_RUN_S = 600  # past this, the estimate comes with the flags that shrink the run


def say_how_long(cfg: TrainConfig, seconds: float, steps: int, steps_left: int) -> None:
    """One line, early: how long the run will take, and on a long run which flags make it shorter."""
    eta = seconds / steps * steps_left
    line = f"hstap train: ~{seconds / steps:.2f} s/step, {steps_left} steps to go ≈ {eta / 60:.0f} min"
    if eta > LONG_RUN_S and not cfg.time_budget_s:
        line += (" (held-out evaluations extra); shorter: --time-budget 10m, --max-steps, --limit, --max-tokens, "
                 f"--ttt-steps (now {cfg.ttt_steps}), --draft-vocab (now {cfg.draft_vocab})")
    tqdm.write(line)


def step_batches(plan: list[list[int]], step_in_epoch: int, grad_accum: int, dist: distributed.Dist,
                 prefetch: bool) -> tuple[list[list[int]], list[list[int] | None]]:
    """This rank's batches of one optimizer step — plan[first + a * world + rank] for a < grad_accum — and, with
    `prefetch`, the batch to prefill behind each of them (the next one of this rank, never past this epoch)."""
    per_step = dist.world_size * grad_accum
    first = step_in_epoch * per_step
    mine = [plan[first + a * dist.world_size + dist.rank] for a in range(grad_accum)]
    if not prefetch:
        return mine, [None] * grad_accum
    following = first + per_step + dist.rank
    upcoming = plan[following] if first + 2 * per_step <= len(plan) else None
    return mine, [*mine[1:], upcoming]


def step_tokens(plan: list[list[int]], step_in_epoch: int, batches_per_step: int, lengths: list[int]) -> int:
    """The tokens of one optimizer step over every rank: its batches are the plan's next `batches_per_step`, so
    each rank counts them all itself, with no collective and no read-back."""
    first = step_in_epoch * batches_per_step
    return sum(lengths[i] for batch in plan[first:first + batches_per_step] for i in batch)


def accumulate(model: torch.nn.Module, source: SampleSource | BatchSource, batches: list[list[int]],
               layer_ids: list[int], device: torch.device, autocast, dist: distributed.Dist,
               ahead: list[list[int] | None], graphed: GraphedTTT | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward over this rank's batches of one step, gradients averaged over batches and ranks (DDP
    syncs on the last batch only), so N ranks × A batches equal 1 rank × N·A batches up to summation order.
    `ahead[i]`: a batch the source prefetches once batch i is in hand (a BatchSource's prefill, a StoreSource's
    read), so it overlaps batch i's step.
    `graphed`: each batch's forward and backward replayed from its shape's CUDA graph. A model that is not DDP
    (one process, or `--grad-reduce after`) leaves the ranks' gradients apart: the caller averages them.
    Returns, on the device (nothing read back: `StepLog` reads them a step later), the loss averaged over all
    ranks' batches and the per-TTT-step losses averaged over this rank's."""
    losses, step_losses = [], []
    for i, indices in enumerate(batches):
        batch = load_batch(source, indices, layer_ids, device)
        if ahead[i] is not None and isinstance(source, (BatchSource, StoreSource)):
            source.prefetch(ahead[i])
        if graphed is not None:  # adds (loss / grad_accum)'s gradients, as the backward below does
            loss, stats = graphed(batch, autocast)
        else:
            with dist.no_sync(model, last=i == len(batches) - 1):
                with autocast:
                    loss, stats, _, _ = model(*batch_tensors(batch))
                (loss / len(batches)).backward()
        fault_point("train-batch")  # HSTAP_FAULT=train-batch:N: killed mid-step (gradients made, not applied)
        losses.append(loss.detach())
        step_losses.append(stats[0])
    return dist.mean_on_device(torch.stack(losses).mean()), torch.stack(step_losses).mean(0)
