"""`hstap train`: the EAGLE-3 drafter, offline from a store or online with the target in this process.

    hstap train --store runs/cap --out runs/drafter                    # offline
    hstap train --online --model smollm2 --data sharegpt --limit 400 --out runs/drafter
    torchrun --nproc_per_node 2 -m hstap.cli train --store runs/cap --out runs/drafter   # DDP

The run directory holds config.json + model.safetensors (the drafter), train_config.json, metrics.jsonl (also
as TensorBoard scalars under tb/), plots, and checkpoint/ (optimizer, scheduler, RNG, data position) for
`--resume`. Online, the target's prefill writes each batch on the training device (hstap.train.online). Every
evaluation measures τ by real speculative decoding on a few held-out prompts next to the estimate
(hstap.train.calibrate).

Where the parts live: hstap.train.build opens the samples and builds the drafter, hstap.train.trainer runs the
steps, checkpoints and evaluations, hstap.train.budget fits the schedule to `--time-budget`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from hstap.drafter import fused
from hstap.errors import HstapError
from hstap.train import build, checkpoint, distributed, resume, rundir
from hstap.train.config import TrainConfig
from hstap.train.data import split_heldout
from hstap.train.steplog import NonFiniteStep
from hstap.train.stop import TrainStop
from hstap.train.trainer import Trainer, TrainResult


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
            trainer = _build_trainer(cfg)
            if (finished := trainer.open_run(changed, cleanup)) is not None:
                return finished
            trainer.start(progress)
            trainer.train(stop)
            return trainer.finish(stop)
        except NonFiniteStep as exc:
            raise HstapError(_non_finite(exc, Path(cfg.out))) from None


def _build_trainer(cfg: TrainConfig) -> Trainer:
    """The process group, the target, the samples checked against it and split, and the drafter to train."""
    from hstap.models import load_target

    dist = distributed.setup(cfg.device)
    # the target sits on the device when it prefills (online) or decodes the calibration prompts (rank 0)
    on_device = cfg.online or (cfg.calib_prompts > 0 and cfg.heldout > 0 and dist.rank == 0)
    target = load_target(cfg.model, device=str(dist.device) if on_device else "cpu")
    source, layer_ids, teacher = build.open_source(cfg, target, dist.device)
    if teacher.kind == "topk" and teacher.k < 1:
        raise HstapError(f"store teacher {teacher}: expected top-k log-probs or a hidden teacher")
    if cfg.resume:
        build.check_resume_compatible(Path(cfg.out), layer_ids, target.hidden_size, target.fingerprint,
                                      draft_vocab=min(cfg.draft_vocab, target.model.config.vocab_size),
                                      intermediate=cfg.draft_intermediate or target.model.config.intermediate_size)
    train_idx, held_idx = split_heldout(source.ids, cfg.heldout, cfg.seed)
    if cfg.heldout > 0 and not held_idx and dist.rank == 0 and not cfg.resume:  # a resumed run said so already
        tqdm.write(f"hstap train: --heldout {cfg.heldout:g} of {len(source.ids)} samples holds none out: the run "
                   "reports no held-out loss, top-1 or τ estimate")
    if not train_idx:
        raise HstapError(f"no training samples after holding out {cfg.heldout:.0%} of {len(source.ids)}")
    drafter = build.build_drafter(cfg, target, source, train_idx, layer_ids).to(dist.device)
    return Trainer(cfg, dist, target, source, layer_ids, drafter, train_idx, held_idx)


def _non_finite(exc: NonFiniteStep, out: Path) -> str:
    """The one line a NaN/inf step stops the run with: the step, its numbers, what is kept, what to do."""
    kept = checkpoint.read_meta(out)
    then = (f"the checkpoint of step {kept['step']} is kept (nothing after it written): remove the NaN/inf states "
            "from the data and run the same command with --resume, or start again with a lower --lr (--overwrite)"
            ) if kept else ("no checkpoint had been written, so the run left nothing in --out: remove the NaN/inf "
                            "states from the data or lower --lr, then run the command again")
    return f"step {exc.step}: the loss turned {exc.loss} (gradient norm {exc.grad_norm}); training stopped: {then}"


def load_metrics(path: Path) -> list[dict]:
    """metrics.jsonl as records: one per step, evaluation, budget fit or resume."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
