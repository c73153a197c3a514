"""`hstap synth`: flags → SynthConfig → run_synth."""

from __future__ import annotations

from hstap.config import add_config_flags
from hstap.synth.config import SynthConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, SynthConfig, "synth")


def run(cfg: SynthConfig) -> int:
    from hstap.synth.run import run_synth

    result = run_synth(cfg)
    print(result.summary())
    return 1 if result.failed else 0  # permanent failures are reported, and a re-run would not fix them
