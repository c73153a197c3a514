"""Loading a trained drafter for decoding: a run directory or a shipped drafter's name, checked against the target
it will draft for and placed on that target's device.

    target = load_target("smollm2")
    drafter = load_drafter("reference", target)      # or a `hstap train` run directory

Every stage that decodes with a drafter (hstap eval, the `hf` server) loads it here, so a drafter trained for
another target is refused the same way everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hstap.drafter.model import Eagle3Drafter
from hstap.drafter.shipped import resolve_drafter
from hstap.errors import HstapError

if TYPE_CHECKING:
    from hstap.models.target import Target


def load_drafter(run_dir: Path | str, target: Target) -> Eagle3Drafter:
    """The drafter of a `hstap train` run directory (or a shipped drafter's name), checked against the target and
    placed on its device."""
    run_dir = resolve_drafter(run_dir)
    drafter = Eagle3Drafter.from_pretrained(run_dir, target_model=target.model)
    cfg = drafter.config
    if cfg.target_fingerprint != target.fingerprint:
        raise HstapError(f"{run_dir} was trained against {cfg.target_model_id} (fingerprint "
                         f"{cfg.target_fingerprint}); the target loaded has fingerprint {target.fingerprint}: "
                         "pass the --model it was trained for")
    if cfg.vocab_size != target.model.config.vocab_size or max(cfg.aux_layer_ids) >= target.num_layers:
        raise HstapError(f"{run_dir}: drafter expects vocab {cfg.vocab_size} and layers {cfg.aux_layer_ids}, "
                         f"the target has vocab {target.model.config.vocab_size} and {target.num_layers} layers")
    return drafter.to(device=target.model.device, dtype=target.model.dtype).eval()
