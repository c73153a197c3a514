"""`hstap train`: the EAGLE-3 drafter, offline from a store or online with the target in this process.

    hstap train --store runs/cap --out runs/drafter                    # offline
    hstap train --online --model smollm2 --data sharegpt --limit 400 --out runs/drafter
    torchrun --nproc_per_node 2 -m hstap.cli train --store runs/cap --out runs/drafter   # DDP

The run directory holds config.json + model.safetensors (the drafter), train_config.json, metrics.jsonl (also
as TensorBoard scalars under tb/), plots, and checkpoint/ (optimizer, scheduler, RNG, data position) for
`--resume`. Online, the target's prefill writes each batch on the training device (hstap.train.online). Every
evaluation measures τ by real speculative decoding on a few held-out prompts next to the estimate
(hstap.train.calibrate).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hstap.drafter import (DrafterConfig, Eagle3Drafter, build_draft_vocab, count_tokens, fused, grow_draft_vocab,
                           target_to_draft_ids)
from hstap.drafter.shipped import resolve_drafter
from hstap.config import TeacherSpec
from hstap.errors import HstapError
from hstap.faults import fault_point
from hstap.metrics import tokens_per_second
from hstap.train import checkpoint, distributed, resume, rundir
from hstap.train.config import TrainConfig
from hstap.train.calibrate import calibrate, calibration_indices, prompt_of
from hstap.train.data import BatchSource, SampleSource, StoreSource, load_batch, plan_batches, split_heldout
from hstap.train.gradsync import FlatGradients
from hstap.train.graphed import GraphedTTT
from hstap.train.heldout import evaluate_heldout, replayed_first_answers
from hstap.train.online import DeviceOnlineSource
from hstap.train.steplog import NonFiniteStep, StepLog
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


def _open_source(cfg: TrainConfig, target, device: torch.device) -> tuple[SampleSource | BatchSource, list[int],
                                                                         TeacherSpec]:
    """The sample source, its canonical layer ids and the teacher spec, checked against the target."""
    from hstap.capture.layers import parse_layers

    if cfg.online:
        from hstap.data import SkipReport, render_all

        layer_ids = parse_layers(cfg.layers, target.num_layers)
        report = SkipReport()
        samples = render_all(cfg.data, target.tokenizer, report, max_tokens=cfg.max_tokens, limit=cfg.limit,
                             loops=cfg.loops)
        if not samples:
            raise HstapError(f"--data {cfg.data}: no usable conversations ({report.summary()})")
        tqdm.write(f"hstap train: {len(samples)} samples from {cfg.data}; {report.summary()}")
        teacher = TeacherSpec()
        source = DeviceOnlineSource(target, samples, layer_ids, teacher=teacher, device=str(device),
                                    as_fp8=cfg.online_dtype == "fp8")
        return source, layer_ids, teacher
    from hstap.store import open_store

    store = open_store(cfg.store, skip_bad_shards=cfg.skip_bad_shards)
    if store.skipped:
        s = store.skipped
        tqdm.write(f"hstap train: skipped {len(s)} damaged shards of {len(s) + len(store.manifest.shards)} "
                   f"({sum(x.samples for x in s)} samples, {sum(x.tokens for x in s)} tokens left out): "
                   + "; ".join(x.problem for x in s))
    meta = store.manifest.meta
    if len(store) == 0:
        raise HstapError(f"store {cfg.store} is empty: run `hstap capture --out {cfg.store}` first")
    if meta.model_fingerprint != target.fingerprint:
        raise HstapError(f"store {cfg.store} was captured from {meta.model_id} (fingerprint "
                         f"{meta.model_fingerprint}), --model {cfg.model} has fingerprint {target.fingerprint}")
    if meta.hidden_size != target.hidden_size:
        raise HstapError(f"store {cfg.store}: hidden_size={meta.hidden_size}, the target's is {target.hidden_size}")
    _check_store_tensors(cfg.store, store.manifest, meta.layer_ids)
    rundir.check_loss_on(cfg.loss_on, meta.extra.get("loops", "keep"),
                         f"the capture of store {cfg.store} (--loops cut)")
    if cfg.limit is not None and cfg.limit < len(store):
        raise HstapError(f"--limit {cfg.limit} is for --online; train on a store of that size instead")
    head = target.model.get_output_embeddings()
    if meta.teacher.kind == "hidden":  # its top-k is made per batch where the head lives: there, not on a CPU
        head = teacher_head(head, device)
    return StoreSource(store, lm_head=head, pin=device.type == "cuda"), list(meta.layer_ids), meta.teacher


def teacher_head(head: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The target's lm_head on the training device, for a store whose teacher is the final hidden state: the target
    itself stays on the CPU unless it prefills or calibrates, and an 8B head's 2,048 × 4,096 × 128,256 logits a
    sample (2.1 TFLOP) are milliseconds of a GPU's time but ~9 s of a 2-core VM's. A copy (1 GB in bf16 for 8B)
    where it is elsewhere."""
    if head.weight.device == device:
        return head
    dtype = torch.bfloat16 if device.type == "cuda" else head.weight.dtype
    return copy.deepcopy(head).to(device, dtype).requires_grad_(False)


def _check_store_tensors(path, manifest, layer_ids: list[int]) -> None:
    names = set(manifest.tensors)
    needed = {"input_ids", "loss_mask", *(f"hidden.{k}" for k in layer_ids)}
    if manifest.meta.hidden_dtype == "fp8":
        needed |= {f"hidden_scale.{k}" for k in layer_ids}
    teacher = {"teacher.topk_ids", "teacher.topk_logprobs"} if manifest.meta.teacher.kind == "topk" \
        else {"teacher.hidden"}
    missing = sorted((needed | teacher) - names)
    if missing:
        raise HstapError(f"store {path}: missing tensor(s) {missing} (has {sorted(names)}); re-capture it")


def _check_resume_compatible(out: Path, layer_ids: list[int], hidden_size: int, fingerprint: str,
                             flag: str = "--resume", draft_vocab: int | None = None,
                             intermediate: int | None = None) -> None:
    """A resumed (or initialised) run must read the same layers of the same target as the drafter it continues; a
    resumed one (`draft_vocab`, `intermediate` given) must also build its head size and MLP width, or the checkpoint
    would fail inside load_state_dict with a size-mismatch traceback (a grown run resumed without its flags, say)."""
    prior = DrafterConfig.load(out / "config.json")
    for field, mine, now in [("aux_layer_ids", prior.aux_layer_ids, layer_ids),
                             ("target_hidden_size", prior.target_hidden_size, hidden_size),
                             ("target_fingerprint", prior.target_fingerprint, fingerprint)]:
        if mine != now:
            raise HstapError(f"{flag}: drafter in {out} has {field}={mine}, the training data give {now}")
    if draft_vocab is not None and prior.draft_vocab_size != draft_vocab:
        raise HstapError(f"{flag}: the run in {out} trains a {prior.draft_vocab_size:,}-token draft vocabulary, this "
                         f"command builds {draft_vocab:,}: pass --draft-vocab {prior.draft_vocab_size}, as the run's "
                         "command did")
    if intermediate is not None and prior.intermediate_size != intermediate:
        raise HstapError(f"{flag}: the run in {out} trains an MLP of {prior.intermediate_size:,} units, this command "
                         f"builds {intermediate:,}: pass --draft-intermediate {prior.intermediate_size}, as the run's "
                         "command did")


def _build_drafter(cfg: TrainConfig, target, source: SampleSource, train_idx: list[int],
                   layer_ids: list[int]) -> Eagle3Drafter:
    vocab = target.model.config.vocab_size
    size = min(cfg.draft_vocab, vocab)
    if cfg.init_from is not None:
        return _init_drafter(cfg, target, source, train_idx, layer_ids, size)
    d2t, t2d = build_draft_vocab(_count_tokens(source, train_idx, vocab), size)
    dcfg = DrafterConfig.from_target(target.model.config, layer_ids, size, target.model_id, target.fingerprint,
                                     intermediate_size=cfg.draft_intermediate)
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Drafter(dcfg)
    drafter.init_from_target(target.model, d2t, t2d)
    return drafter


def _init_drafter(cfg: TrainConfig, target, source: SampleSource, train_idx: list[int], layer_ids: list[int],
                  size: int) -> Eagle3Drafter:
    """A drafter trained earlier (another session, a smaller set) keeps learning, over its own draft vocabulary or,
    when `size` (TrainConfig.init_size: never smaller) is larger, over it plus the most frequent tokens it misses
    (each is a certain rejection whenever the target emits it); and with its own MLP or, when
    --draft-intermediate is larger, a wider one that starts out computing what the init drafter computes."""
    init = resolve_drafter(cfg.init_from, flag="--init-from")  # a run directory or a shipped drafter's name
    _check_resume_compatible(init, layer_ids, target.hidden_size, target.fingerprint, flag="--init-from")
    drafter = Eagle3Drafter.from_pretrained(init, target.model).float()
    have, width = drafter.config.draft_vocab_size, drafter.config.intermediate_size
    assert size >= have, f"draft vocabulary {size} < the init drafter's {have}: TrainConfig.init_size refuses it"
    if size > have:
        d2t, t2d = grow_draft_vocab(_count_tokens(source, train_idx, drafter.config.vocab_size), drafter.t2d, size)
        torch.manual_seed(cfg.seed)  # the new rows start where a fresh drafter's would
        tqdm.write(f"hstap train: draft vocabulary grown from {have:,} to {size:,} tokens: {size - have:,} new rows "
                   "start from a fresh head's initialisation")
        drafter = drafter.with_draft_vocab(d2t, t2d)
    if cfg.draft_intermediate is not None and cfg.draft_intermediate > width:
        torch.manual_seed(cfg.seed + 1)  # the new units' gate and up rows
        tqdm.write(f"hstap train: MLP grown from {width:,} to {cfg.draft_intermediate:,} units; the new ones start "
                   "with a zero output (the drafter computes what it did)")
        drafter = drafter.with_mlp_width(cfg.draft_intermediate)
    return drafter


def _count_tokens(source: SampleSource, train_idx: list[int], vocab: int) -> torch.Tensor:
    """Target-token counts over the training split's loss-masked positions: what the draft vocabulary is made of."""
    masks = (dict(zip(("input_ids", "loss_mask"), source.token_masks(i)))
             for i in tqdm(train_idx, desc="draft vocab", unit="sample", leave=False, disable=len(train_idx) < 2000))
    return count_tokens(masks, vocab)


class WarmupCosine:
    """Linear warmup, then cosine to zero at `total` steps.

    A callable object rather than a closure because LambdaLR checkpoints an object's attributes: a run fitted
    to a time budget resumes with the fitted schedule, not a new fit."""

    def __init__(self, total: int, warmup_ratio: float):
        self.total = total
        self.warmup_ratio = warmup_ratio
        self.fitted = False  # the time budget has been applied

    def __call__(self, step: int) -> float:
        warmup = max(1, int(self.total * self.warmup_ratio))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


PROBE_SKIP, PROBE_STEPS = 3, 10  # steps ignored (allocator, kernels warming up), then steps timed


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


REFIT_EVERY = 50  # a budgeted run re-fits its step count to the steps it has timed this often (and at epoch ends)


def refit_to_budget(cap: int, step: int, seconds_per_step: float, seconds_left: float, eval_seconds: float,
                    steps_per_epoch: int, step_in_epoch: int) -> int:
    """`fit_to_budget` again mid-run, from the steps really timed so far instead of the probe's (on 2026-12-03 the
    probe timed 0.73 s a step where the run then took 0.22, recompiles for new shapes among its 10 steps, and a
    510-s budget trained for 148 s), and with the held-out evaluations still to come, `eval_seconds` each (the
    epoch ends ahead, and the one at a mid-epoch stop), taken out of the budget. Never past `cap` (the
    run's own end); `step` itself when the budget is spent (unlike the first fit, a refit may stop the run now)."""
    def fit(seconds: float) -> int:
        return max(step, min(cap, step + int(seconds / seconds_per_step)))

    total = fit(seconds_left)
    for _ in range(2):  # the evaluations depend on where the run ends, which depends on them: two passes settle it
        evals = -(-(step_in_epoch + total - step) // max(1, steps_per_epoch))  # epoch ends ahead, + a mid-epoch stop
        total = fit(seconds_left - evals * eval_seconds)
    return total


def run_train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Train a drafter; see the module docstring. Rank 0 writes the run directory. Sizes left unset in `cfg` are
    filled in for its device first (TrainConfig.sized_for_device).

    Stops: SIGTERM/SIGINT write the checkpoint of the step in flight, then raise `Interrupted` (hstap.train.stop);
    a loss or gradient that turns NaN or inf raises HstapError naming the step, the last checkpoint kept and none
    written past it. A fresh run that fails before its first checkpoint leaves nothing in `--out` that would block
    the corrected command (rundir.EarlyFailureCleanup)."""
    cfg = cfg.sized_for_device()
    fused.enable(cfg.compile)
    rundir.preflight(cfg)  # no model, no process group yet: bad flags and a run directory in use fail at once
    changed = resume.changed_flags(Path(cfg.out), cfg) if cfg.resume else {}  # refused ones: one line, now
    with TrainStop() as stop, rundir.EarlyFailureCleanup(Path(cfg.out), fresh=not cfg.resume) as cleanup:
        try:
            return _train(cfg, changed, stop, cleanup, progress)
        except NonFiniteStep as exc:
            raise HstapError(_non_finite(exc, Path(cfg.out))) from None


def _non_finite(exc: NonFiniteStep, out: Path) -> str:
    """The one line a NaN/inf step stops the run with: the step, its numbers, what is kept, what to do."""
    kept = checkpoint.read_meta(out)
    then = (f"the checkpoint of step {kept['step']} is kept (nothing after it written): remove the NaN/inf states "
            "from the data and run the same command with --resume, or start again with a lower --lr (--overwrite)"
            ) if kept else ("no checkpoint had been written, so the run left nothing in --out: remove the NaN/inf "
                            "states from the data or lower --lr, then run the command again")
    return f"step {exc.step}: the loss turned {exc.loss} (gradient norm {exc.grad_norm}); training stopped: {then}"


def _train(cfg: TrainConfig, changed: dict[str, tuple], stop: TrainStop, cleanup: rundir.EarlyFailureCleanup,
           progress: bool) -> TrainResult:
    """`run_train` inside its signal handlers and early-failure cleanup; `changed`: the --epochs/--max-steps a
    resume changes (hstap.train.resume)."""
    from hstap.models import load_target

    dist = distributed.setup(cfg.device)
    device = dist.device
    # the target sits on the device when it prefills (online) or decodes the calibration prompts (rank 0)
    on_device = cfg.online or (cfg.calib_prompts > 0 and cfg.heldout > 0 and dist.rank == 0)
    target = load_target(cfg.model, device=str(device) if on_device else "cpu")
    source, layer_ids, teacher = _open_source(cfg, target, device)
    if teacher.kind == "topk" and teacher.k < 1:
        raise HstapError(f"store teacher {teacher}: expected top-k log-probs or a hidden teacher")
    if cfg.resume:
        _check_resume_compatible(Path(cfg.out), layer_ids, target.hidden_size, target.fingerprint,
                                 draft_vocab=min(cfg.draft_vocab, target.model.config.vocab_size),
                                 intermediate=cfg.draft_intermediate or target.model.config.intermediate_size)
    train_idx, held_idx = split_heldout(source.ids, cfg.heldout, cfg.seed)
    if cfg.heldout > 0 and not held_idx and dist.rank == 0 and not cfg.resume:  # a resumed run said so already
        tqdm.write(f"hstap train: --heldout {cfg.heldout:g} of {len(source.ids)} samples holds none out: the run "
                   "reports no held-out loss, top-1 or τ estimate")
    if not train_idx:
        raise HstapError(f"no training samples after holding out {cfg.heldout:.0%} of {len(source.ids)}")

    drafter = _build_drafter(cfg, target, source, train_idx, layer_ids).to(device)
    # train_config.json: the sizes used
    cfg = cfg.model_copy(update={"draft_vocab": drafter.config.draft_vocab_size,
                                 "draft_intermediate": drafter.config.intermediate_size})
    t2d_ids = target_to_draft_ids(drafter.d2t, drafter.config.vocab_size).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                  fused=device.type == "cuda")  # one kernel for all parameters
    batches_per_step = dist.world_size * cfg.grad_accum  # batches in one optimizer step, all ranks together

    def epoch_plan(epoch: int) -> list[list[int]]:
        return plan_batches(train_idx, source.lengths, cfg.batch_tokens, cfg.seed, epoch, batches_per_step)

    steps_per_epoch = len(epoch_plan(0)) // batches_per_step
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    schedule = WarmupCosine(total_steps, cfg.warmup_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model = TTTModel(drafter, t2d_ids, cfg.ttt_steps, cfg.decay, cfg.ttt_attention, cfg.loss_on)
    # several ranks: DDP's hooks all-reduce during the backward, or one flat all-reduce after it (--grad-reduce)
    bf16_wire = cfg.grad_reduce_dtype == "bf16"
    flat = FlatGradients(params, dist, torch.bfloat16 if bf16_wire else None) \
        if dist.enabled and cfg.reduce_after else None
    model = model if flat is not None else dist.wrap(model, bf16_gradients=bf16_wire)
    graphed = GraphedTTT(model, 1 / cfg.grad_accum, cfg.batch_tokens) if cfg.cuda_graphs else None
    keep_grads = graphed is not None or flat is not None  # gradients the graphs or the flat buffer write into

    out = Path(cfg.out)
    state = checkpoint.State(batches_per_step=batches_per_step)
    if cfg.resume:
        state = checkpoint.load(out, drafter, optimizer, scheduler)
        if state.batches_per_step != batches_per_step:
            raise HstapError(f"--resume: the checkpoint in {out} took {state.batches_per_step} batches per step "
                             f"(ranks × --grad-accum), this run takes {batches_per_step} ({dist.world_size} × "
                             f"{cfg.grad_accum}): set --grad-accum so the global batch is the same")
        if not schedule.fitted:  # --epochs/--max-steps as this command gives them (resume.py: the rule)
            resume.reschedule(schedule, scheduler, total_steps)
        if (state.step >= schedule.total or state.epoch >= cfg.epochs) and resume.drafter_written_at(out, state.step):
            return TrainResult(out, state.step, state.train_tokens, 0.0, {}, state.initial_heldout,
                               already_finished=True)
        if dist.rank == 0:
            checkpoint.cut_to(out, state.step)
            resume.write_config(out, resume.as_recorded(out, cfg))  # the flags it runs with now, --max-steps included
    elif dist.rank == 0:
        cleanup.wrote = True  # from here the files in --out are this run's: removed if it fails before a checkpoint
        if cfg.overwrite:
            rundir.clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        resume.write_config(out, cfg)
        drafter.config.save(out / "config.json")
        (out / "metrics.jsonl").write_text("")
    log = checkpoint.MetricsLog(out / "metrics.jsonl", enabled=dist.rank == 0, tensorboard=out / "tb",
                                purge_step=state.step if cfg.resume else None)
    if changed:
        log.write({"kind": "resume", "step": state.step, "total_steps": schedule.total,
                   "changed": {name: list(pair) for name, pair in changed.items()}})
    calib_idx = calibration_indices(source, held_idx, cfg.calib_prompts) if dist.rank == 0 else []
    prompts = [prompt_of(source, i) for i in calib_idx]

    def heldout_eval(calibrated: bool = True) -> dict:
        """Held-out metrics, and τ measured on `prompts` next to the estimate (rank 0 only)."""
        result = evaluate_heldout(drafter, source, held_idx, layer_ids, t2d_ids, cfg, device)
        if calibrated and prompts:
            chain = min(cfg.calib_chain, cfg.ttt_steps)
            same = replayed_first_answers(drafter, source, calib_idx, layer_ids, t2d_ids, cfg, device, chain,
                                          cfg.calib_tokens)
            result["calibration"] = calibrate(target, drafter, prompts, chain, cfg.calib_tokens,
                                              result.get("tau_est", {}), same)
        return result

    def log_eval(result: dict) -> None:
        log.write({"kind": "eval", "epoch": state.epoch, "step": state.step, **result})
        log.flush()  # a TensorBoard watching the run sees every evaluation as it lands

    eval_started = time.perf_counter()
    initial = state.initial_heldout or (heldout_eval(calibrated=False) if dist.rank == 0 else {})
    eval_seconds = time.perf_counter() - eval_started  # the last held-out evaluation's wall time (a budget's refits)
    if not state.initial_heldout and dist.rank == 0:
        log_eval(initial)
    state.initial_heldout = initial

    autocast = ttt_autocast(device)
    total_steps = cap = schedule.total  # a resumed budgeted run keeps the schedule it was fitted to
    bar = tqdm(total=total_steps, initial=state.step, desc="train", unit="step", disable=not progress or dist.rank)
    steplog = StepLog(log.write, bar)
    # a store's next batch is read on a host thread while a GPU trains; on a CPU the host is the device, and the
    # read only competes with the step's own threads (10 % slower on 2 cores): there only when asked
    read_ahead = cfg.prefetch or (isinstance(source, StoreSource) and device.type == "cuda")
    start, tokens_this_run, first_step = time.perf_counter(), 0, state.step
    refits = bool(cfg.time_budget_s and not schedule.fitted)  # fitted here (a resumed run keeps its fit)
    if refits:
        mine = epoch_plan(state.epoch)[dist.rank::dist.world_size]
        seconds = cfg.grad_accum * dist.agree_max(seconds_per_step(model, source, mine, layer_ids, device, autocast,
                                                                   graphed))
        schedule.total = total_steps = fit_to_budget(total_steps, state.step, seconds,
                                                     cfg.time_budget_s - dist.agree_max(time.perf_counter() - start))
        schedule.fitted = True  # every rank agreed on the per-step and elapsed times, so they stop at the same step
        bar.total = total_steps
        bar.refresh()
        log.write({"kind": "budget", "step": state.step, "seconds_per_step": seconds, "total_steps": total_steps,
                   "probe_steps": sum(probe_sizes(len(mine)))})
    last_eval = initial
    due = rundir.CheckpointClock(cfg.checkpoint_every, cfg.checkpoint_interval_s)
    time_vote = distributed.LateVote(dist)  # no per-step wait on the device for it
    steps_from = time.perf_counter()  # the early estimate times training steps only (not the budget probe)
    evals_took = 0.0  # of the time since steps_from, the epoch-end evaluations'

    def refit(total: int) -> int:
        """The budgeted run's step count from the steps timed so far (every rank agrees on the slowest)."""
        if state.step == first_step:
            return total
        evals = dist.agree_max(evals_took)  # rank 0 evaluates; the others wait for it at the next collective
        per_step = dist.agree_max((time.perf_counter() - steps_from - evals) / (state.step - first_step))
        left = cfg.time_budget_s - dist.agree_max(time.perf_counter() - start)  # ranks started apart: agreed too
        fitted = refit_to_budget(cap, state.step, per_step, left, dist.agree_max(eval_seconds), steps_per_epoch,
                                 state.step_in_epoch)
        if fitted != total:
            log.write({"kind": "budget_refit", "step": state.step, "seconds_per_step": per_step,
                       "total_steps": fitted})
            bar.total = fitted
            bar.refresh()
        return fitted

    stop.defer()  # from here a signal ends the loop after the step in flight, its checkpoint written
    while state.step < total_steps and state.epoch < cfg.epochs:
        plan = epoch_plan(state.epoch)
        while state.step_in_epoch < len(plan) // batches_per_step and state.step < total_steps:
            mine, ahead = _step_batches(plan, state.step_in_epoch, cfg.grad_accum, dist,
                                        prefetch=read_ahead and state.step + 1 < total_steps)
            loss, step_losses = accumulate(model, source, mine, layer_ids, device, autocast, dist, ahead, graphed)
            if flat is not None:
                flat.average()  # every rank's gradients averaged, as DDP's backward would have left them
            tokens = step_tokens(plan, state.step_in_epoch, batches_per_step, source.lengths)  # every rank's
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)  # on the device: nothing read back
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads)  # zeroed in place where graphs or views add into them
            scheduler.step()
            state.step += 1
            state.step_in_epoch += 1
            state.train_tokens += tokens
            tokens_this_run += tokens
            rate = tokens_per_second(tokens_this_run, time.perf_counter() - start)
            record = {"kind": "train", "step": state.step, "epoch": state.epoch, "tokens": state.train_tokens,
                      "loss": None, "step_losses": None, "lr": scheduler.get_last_lr()[0], "grad_norm": None,
                      "tokens_per_s": rate}  # the numbers the device holds are filled in a step later
            steplog.hold(record, loss, grad_norm, step_losses)
            bar.update(1)
            if state.step - first_step == ETA_AFTER_STEPS and dist.rank == 0:
                _say_how_long(cfg, time.perf_counter() - steps_from, ETA_AFTER_STEPS, total_steps - state.step)
            # ranks' clocks differ: any rank's clock due, all save (learned a step late on several ranks); a signal
            # to any rank rides on the same vote, so all stop after the same step (hstap.train.stop)
            vote = time_vote(stop.code(due.by_time()))
            stop.agreed(vote)
            if due.by_steps(state.step) or vote:
                steplog.flush()  # the metrics hold every step the checkpoint does; a NaN step stops the run here
                checkpoint.save(out, drafter, optimizer, scheduler, state, dist)
                due.saved()
                time_vote.clear()
                if vote >= STOP:
                    log.close()
                    stop.raise_stopped(f"the checkpoint of step {state.step} is written in {out}; run the same "
                                       "command with --resume to continue from it")
            fault_point("step-done")  # HSTAP_FAULT=step-done:N: a preemption right after step N
            if refits and (state.step - first_step) % REFIT_EVERY == 0 and state.step < total_steps:
                schedule.total = total_steps = refit(total_steps)
        if state.step_in_epoch >= len(plan) // batches_per_step:
            state.epoch += 1
            state.step_in_epoch = 0
            steplog.flush()  # the epoch's last step before its evaluation
            if dist.rank == 0:
                eval_started = time.perf_counter()
                last_eval = heldout_eval()
                log_eval(last_eval)
                eval_seconds = time.perf_counter() - eval_started
                evals_took += eval_seconds
            if refits and state.step < total_steps:
                schedule.total = total_steps = refit(total_steps)
    steplog.flush()
    bar.close()
    # the last step's checkpoint before the final evaluation: a stop or a crash during it (or during the drafter's
    # write) loses no step; the resume evaluates and writes the drafter without training
    checkpoint.save(out, drafter, optimizer, scheduler, state, dist)
    stop.agreed(STOP if dist.agree_max(float(stop.signum is not None)) else 0)
    if stop.signum is not None:  # it came after the last step's vote: the checkpoint just written holds that step
        log.close()
        stop.raise_stopped(f"the checkpoint of step {state.step}, the run's last, is written in {out}; run the same "
                           "command with --resume to evaluate it and write the drafter")
    stop.defer(False)  # a signal from here stops at once: the checkpoint holds every step
    # nothing trained (killed after the last checkpoint, before its drafter was written): evaluated already?
    logged = resume.logged_eval(out, state.step) if state.step == first_step and cfg.resume and dist.rank == 0 else None
    if logged is not None:
        last_eval = logged
    # a run that stops mid-epoch (a step or time budget) is judged where it stopped, not at its last epoch's end
    elif dist.rank == 0 and (last_eval is initial or state.step_in_epoch > 0):
        last_eval = heldout_eval()
        log_eval(last_eval)
        checkpoint.cover_metrics(out)  # an extension of this run (--resume --epochs N) keeps this evaluation
    log.close()
    error = _save_final(drafter, out, state.step) if dist.rank == 0 else None
    if dist.agree_max(float(error is not None)):  # also the barrier: no rank waits on a rank 0 that failed
        raise HstapError(error or "rank 0 could not write the trained drafter")
    return TrainResult(out, state.step, state.train_tokens, time.perf_counter() - start, last_eval, initial, drafter)


def _save_final(drafter: Eagle3Drafter, out: Path, step: int) -> str | None:
    """Write the drafter's weights and the plots; on a full disk, the one-line error to raise on every rank (the
    final checkpoint is in place: `--resume` writes them again without training)."""
    from hstap.train.plots import plot_metrics

    from safetensors import SafetensorError

    try:
        drafter.save_pretrained(out, step=step)  # the step marks it as the finished run's (resume.drafter_written_at)
        plot_metrics(out / "metrics.jsonl", out)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as SafetensorError
        why = getattr(exc, "strerror", None) or str(exc)
        return (f"{out}: {why} while writing the trained drafter; the checkpoint of step {step} is in place: free "
                "space, then run the same command with --resume")
    return None


ETA_AFTER_STEPS = 3  # steps timed before the run says how long it will take
LONG_RUN_S = 600  # past this, the estimate comes with the flags that shrink the run


def _say_how_long(cfg: TrainConfig, seconds: float, steps: int, steps_left: int) -> None:
    """One line, early: how long the run will take, and on a long run which flags make it shorter."""
    eta = seconds / steps * steps_left
    line = f"hstap train: ~{seconds / steps:.2f} s/step, {steps_left} steps to go ≈ {eta / 60:.0f} min"
    if eta > LONG_RUN_S and not cfg.time_budget_s:
        line += (" (held-out evaluations extra); shorter: --time-budget 10m, --max-steps, --limit, --max-tokens, "
                 f"--ttt-steps (now {cfg.ttt_steps}), --draft-vocab (now {cfg.draft_vocab})")
    tqdm.write(line)


def _step_batches(plan: list[list[int]], step_in_epoch: int, grad_accum: int, dist: distributed.Dist,
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


def load_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
