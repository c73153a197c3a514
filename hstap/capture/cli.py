"""`hstap capture`: flags → CaptureConfig → run_capture."""

from __future__ import annotations

import os

from hstap.capture.config import CaptureConfig
from hstap.config import add_config_flags


def add_arguments(parser) -> None:
    add_config_flags(parser, CaptureConfig, "capture")


def run(cfg: CaptureConfig) -> int:
    import torch

    from hstap.capture.run import run_capture
    from hstap.store import store_info
    from hstap.store.cli import format_info

    result = run_capture(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 holds the store
        print(result.summary())
        print(format_info(store_info(cfg.out)))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if result.tap_report.errors else 0
