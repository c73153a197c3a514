"""`hstap prompts`: flags → PromptsConfig → build_prompts (hstap/synth/prompts.py)."""

from __future__ import annotations

from hstap.config import add_config_flags, plan_text
from hstap.data.config import PromptsConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, PromptsConfig, "prompts")


def plan(cfg: PromptsConfig) -> str:
    """The resolved config, then each source's quota as comments (the output stays a valid --config file)."""
    quotas = ", ".join(f"{name} {n}" for name, n in cfg.quotas().items())
    return plan_text(cfg, "prompts") + f"# quotas of --total {cfg.total}: {quotas}\n"


def run(cfg: PromptsConfig) -> int:
    from hstap.synth.prompts import build_prompts

    print(build_prompts(cfg).summary())
    return 0
