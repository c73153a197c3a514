"""Canonical layer ids — the one convention hstap stores and exports.

Layer k (canonical) = the residual stream after decoder layer k (0-based)
                    = transformers `output_hidden_states[k + 1]` (for k < L - 1; HF's last entry is post-norm)
                    = SGLang `output[0] + output[1]` of layer k = vLLM `aux_hidden_state_layers` id k + 1.
Convert at an engine adapter's edge only; everything inside hstap speaks canonical ids.
"""

from __future__ import annotations

from hstap.errors import HstapError


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice: one low, one middle, one high layer — [1, L//2 - 1, L - 4]."""
    if num_layers < 5:
        raise HstapError(f"--layers auto needs a model with at least 5 layers, this one has {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def parse_layers(spec: str | list[int], num_layers: int) -> list[int]:
    """Parse `auto` or `1,14,26` into validated canonical ids: in range, unique, ascending."""
    if isinstance(spec, str):
        if spec.strip() == "auto":
            return default_layers(num_layers)
        try:
            ids = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise HstapError(f"--layers {spec!r}: expected 'auto' or comma-separated integers like 1,14,26") from None
    else:
        ids = list(spec)
    if not ids:
        raise HstapError("--layers is empty: expected 'auto' or comma-separated integers like 1,14,26")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise HstapError(f"--layers {ids}: ids {bad} out of range; canonical ids run 0..{num_layers - 1} for a "
                         f"{num_layers}-layer model")
    if len(set(ids)) != len(ids):
        raise HstapError(f"--layers {ids}: duplicate ids")
    if ids != sorted(ids):
        raise HstapError(f"--layers {ids}: ids must be ascending, e.g. {sorted(ids)}")
    return ids


def to_hf_hidden_states_index(layer_id: int) -> int:
    """Index into transformers' `output_hidden_states` tuple (entry 0 is the embedding output)."""
    return layer_id + 1
