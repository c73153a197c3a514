"""Run by torchrun in test_ddp.py: train with DDP, then save this rank's weights for comparison.

    ddp_worker.py STORE OUT DUMP [MAX_STEPS [STOP_AFTER [GRAD_REDUCE]]]

STOP_AFTER: both ranks leave cleanly right after the checkpoint of that step (a preempted job; 0: never).
GRAD_REDUCE: `hstap train --grad-reduce` (default auto: DDP). Each rank saves its trainable weights to
DUMP/rank<R>.pt when it leaves (at STOP_AFTER, or at the end)."""

import sys
from pathlib import Path

import torch

import hstap.train.run as run_module
from hstap.train.config import TrainConfig
from hstap.train.run import run_train

store, out, dump = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 1
stop_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
grad_reduce = sys.argv[6] if len(sys.argv) > 6 else "auto"
if stop_after:
    real_save = run_module.checkpoint.save

    def save_then_stop(out_dir, drafter, optimizer, scheduler, state, dist):
        real_save(out_dir, drafter, optimizer, scheduler, state, dist)
        if state.step == stop_after:  # this rank's weights at the preemption, then leave
            torch.save({k: v.clone() for k, v in drafter.trainable_state_dict().items()},
                       dump / f"rank{torch.distributed.get_rank()}.pt")
            torch.distributed.destroy_process_group()
            sys.exit(0)

    run_module.checkpoint.save = save_then_stop
cfg = TrainConfig(store=store, out=out, max_steps=max_steps, epochs=10, batch_tokens=512, draft_vocab=2048, ttt_steps=2,
                  heldout=0.05, checkpoint_every=stop_after or 200, calib_prompts=0, grad_reduce=grad_reduce)
result = run_train(cfg, progress=False)
rank = torch.distributed.get_rank()
torch.save({k: v.clone() for k, v in result.drafter.trainable_state_dict().items()}, dump / f"rank{rank}.pt")
torch.distributed.destroy_process_group()
