"""Run by torchrun in test_ddp.py: train one step, then save this rank's weights for comparison."""

import sys
from pathlib import Path

import torch

from hstap.train.run import TrainConfig, run_train

store, out, dump = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
cfg = TrainConfig(store=store, out=out, max_steps=1, batch_tokens=512, draft_vocab=2048, ttt_steps=2, heldout=0.05)
result = run_train(cfg, progress=False)
rank = torch.distributed.get_rank()
torch.save({k: v.clone() for k, v in result.drafter.trainable_state_dict().items()}, dump / f"rank{rank}.pt")
torch.distributed.destroy_process_group()
