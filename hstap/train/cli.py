"""`hstap train`: flags → TrainConfig → run_train."""

from __future__ import annotations

from hstap.config import add_config_flags
from hstap.train.config import TrainConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, TrainConfig, "train")


def run(cfg: TrainConfig) -> int:
    from hstap.train.run import run_train

    print(run_train(cfg).summary())
    return 0
