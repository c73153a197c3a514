"""`hstap train`: flags → TrainConfig → run_train."""

from __future__ import annotations

import os

from hstap.config import add_config_flags
from hstap.train.config import TrainConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, TrainConfig, "train")


def run(cfg: TrainConfig) -> int:
    import torch.distributed as tdist

    from hstap.train.run import run_train

    result = run_train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank trains; rank 0 wrote the run, and says so
        print(result.summary())
    if tdist.is_available() and tdist.is_initialized():  # NCCL warns, and may block a peer, without it
        tdist.destroy_process_group()
    return 0
