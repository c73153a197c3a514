"""The store's names for a captured layer's tensors, spelled and parsed here only.

    hidden_name(14)                 # "hidden.14": the residual stream after decoder layer 14 (hstap's layer ids)
    scale_name(14)                  # "hidden_scale.14": its per-token scales when stored as fp8 (hstap.store.fp8)
    hidden_layer("hidden.14")       # 14; None for any other name ("hidden_scale.14", "teacher.hidden", ...)
    scale_layer("hidden_scale.14")  # 14

Capture writes these names, the store checks and reads them, training and comparison look layers up by them: one
spelling keeps a renamed prefix or a parse by slicing from drifting between stages. Layer ids are the canonical
ones of docs/DESIGN.md ("Layer ids"), never an engine's own.
"""

from __future__ import annotations

HIDDEN_PREFIX = "hidden."
SCALE_PREFIX = "hidden_scale."


def hidden_name(layer: int) -> str:
    """The store name of layer `layer`'s hidden states."""
    return f"{HIDDEN_PREFIX}{layer}"


def scale_name(layer: int) -> str:
    """The store name of layer `layer`'s fp8 scales (one fp32 per token)."""
    return f"{SCALE_PREFIX}{layer}"


def hidden_layer(name: str) -> int | None:
    """The layer id of a hidden-state name (`hidden.14` → 14), None for any other tensor name."""
    return _layer_after(HIDDEN_PREFIX, name)


def scale_layer(name: str) -> int | None:
    """The layer id of an fp8 scales name (`hidden_scale.14` → 14), None for any other tensor name."""
    return _layer_after(SCALE_PREFIX, name)


def _layer_after(prefix: str, name: str) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.removeprefix("-").isdigit() else None
