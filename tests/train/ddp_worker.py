"""Run by torchrun in test_ddp.py: train with DDP, then save this rank's weights for comparison.

    ddp_worker.py STORE OUT DUMP [MAX_STEPS [STOP_AFTER [AFTER_OUT [BUDGET_OUT [TERM_OUT]]]]]

STOP_AFTER: both ranks stop training right after the checkpoint of that step (a preempted job; 0: never). Each
rank saves its trainable weights to DUMP/rank<R>.pt when it stops (at STOP_AFTER, or at the end). AFTER_OUT: then,
in the same processes (no second start-up), a run of MAX_STEPS with `--grad-reduce after` (one all-reduce of a flat
gradient buffer after the backward) into AFTER_OUT, its weights saved to DUMP/after_rank<R>.pt. BUDGET_OUT: then a
run under `--time-budget` on fake clocks that tick a second per batch fetched on rank 0 and 1.5 on rank 1 (ranks
start apart and run at different speeds), its weights and step count saved to DUMP/budget_rank<R>.pt. TERM_OUT:
before the budget run (its fake clock stays), a run of MAX_STEPS into TERM_OUT in which rank 1 alone sends itself
SIGTERM after step 1 (HSTAP_FAULT): how each rank's run ended (the signal it stopped with) goes to
DUMP/term_rank<R>.pt."""

import sys
from pathlib import Path

import torch

import hstap.train.budget as budget_module
import hstap.train.trainer as trainer_module
from hstap.train import checkpoint
from hstap.train.config import TrainConfig
from hstap.train.run import run_train

store, out, dump = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 1
stop_after = int(sys.argv[5]) if len(sys.argv) > 5 else 0
after_out = Path(sys.argv[6]) if len(sys.argv) > 6 else None
budget_out = Path(sys.argv[7]) if len(sys.argv) > 7 else None
term_out = Path(sys.argv[8]) if len(sys.argv) > 8 else None
rank = None


class Preempted(Exception):
    """Both ranks leave the training loop right after the STOP_AFTER checkpoint."""


def weights(drafter) -> dict:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


if stop_after:
    real_save = checkpoint.save

    def save_then_stop(out_dir, drafter, optimizer, scheduler, state, dist):
        real_save(out_dir, drafter, optimizer, scheduler, state, dist)
        if state.step == stop_after and out_dir == out:  # this rank's weights at the preemption, then leave
            torch.save(weights(drafter), dump / f"rank{torch.distributed.get_rank()}.pt")
            raise Preempted

    checkpoint.save = save_then_stop
common = dict(store=store, max_steps=max_steps, epochs=10, batch_tokens=512, draft_vocab=2048, ttt_steps=2,
              heldout=0.05, calib_prompts=0)
try:
    result = run_train(TrainConfig(out=out, checkpoint_every=stop_after or 200, **common), progress=False)
    torch.save(weights(result.drafter), dump / f"rank{torch.distributed.get_rank()}.pt")
except Preempted:
    pass
if after_out is not None:
    result = run_train(TrainConfig(out=after_out, grad_reduce="after", checkpoint_every=200, **common),
                       progress=False)
    torch.save(weights(result.drafter), dump / f"after_rank{torch.distributed.get_rank()}.pt")
if term_out is not None:
    import os

    import hstap.faults as faults
    from hstap.errors import Interrupted

    if torch.distributed.get_rank() == 1:
        os.environ["HSTAP_FAULT"] = "step-done:1:TERM"
    faults.reset()
    try:
        run_train(TrainConfig(out=term_out, checkpoint_every=200, **common), progress=False)
        ended = None
    except Interrupted as exc:
        ended = int(exc.signum)
    os.environ.pop("HSTAP_FAULT", None)
    torch.save({"signum": ended}, dump / f"term_rank{torch.distributed.get_rank()}.pt")
if budget_out is not None:
    clock, tick = {"t": 0.0}, 1.0 + 0.5 * torch.distributed.get_rank()
    real_load = trainer_module.load_batch

    def load_tick(*args, **kw):
        clock["t"] += tick
        return real_load(*args, **kw)

    # every batch fetched ticks the clock: the budget's probe and the training steps
    budget_module.load_batch = trainer_module.load_batch = load_tick
    trainer_module.time.perf_counter = lambda: clock["t"]
    result = run_train(TrainConfig(out=budget_out, time_budget_s=24, checkpoint_every=200,
                                   **{**common, "max_steps": None, "epochs": 50}), progress=False)
    rank = torch.distributed.get_rank()
    torch.save({"steps": result.steps, **weights(result.drafter)}, dump / f"budget_rank{rank}.pt")
torch.distributed.destroy_process_group()
