"""`hstap capture-remote`: flags → RemoteCaptureConfig → run_remote."""

from __future__ import annotations

from hstap.capture.config import RemoteCaptureConfig
from hstap.config import add_config_flags


def add_arguments(parser) -> None:
    add_config_flags(parser, RemoteCaptureConfig, "capture-remote")


def run(cfg: RemoteCaptureConfig) -> int:
    from hstap.capture.remote import run_remote

    result = run_remote(cfg)
    print(result.summary())
    return 0 if not result.missing and not result.failed else 1
