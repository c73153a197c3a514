"""What every forward hook hstap registers shares: find the hidden state in what a module returned, and never raise
into the engine (one rank dying inside a forward leaves the others waiting in a collective forever)."""

from __future__ import annotations

import functools
from typing import Callable

import torch


def first_tensor(output) -> torch.Tensor:
    """The hidden state a module returned: the tensor itself, or the first item of a tuple (transformers < 5
    decoder layers, SGLang's `(hidden, residual)` layers, a norm called with a residual)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def never_raise(report: Callable[[Exception], None]) -> Callable[[Callable], Callable]:
    """Decorate a hook so that any exception goes to `report` (counted, shown at the end) and the hook returns
    None: the forward it runs in goes on, its outputs untouched."""

    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def guarded(*args, **kwargs) -> None:
            try:
                hook(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 — the whole point: never raise into the engine
                report(exc)
            return None
        return guarded

    return wrap
