"""What every forward hook hstap registers shares: find the hidden state in what a module returned, never raise
into the engine (one rank dying inside a forward leaves the others waiting in a collective forever), and notice a
hook that never fires.

A forward hook only runs when the model calls the module (`module(x)`, i.e. `nn.Module.__call__`); a model that
calls `layer.forward(x)` directly bypasses every hook on that layer — SGLang issue 21686 found NemotronH doing so,
and a capture then writes an empty store without a word. `Fired` counts the calls of each hook against the prefill
requests seen, so a capture can stop after `SILENT_AFTER` requests and name the silent modules in one line.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch

from hstap.faults import fault_point

SILENT_AFTER = 4  # prefill requests after which a hook that never fired never will (its module is bypassed)


def first_tensor(output) -> torch.Tensor:
    """The hidden state a module returned: the tensor itself, or the first item of a tuple (transformers < 5
    decoder layers, SGLang's `(hidden, residual)` layers, a norm called with a residual)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def never_raise(report: Callable[[Exception], None]) -> Callable[[Callable], Callable]:
    """Decorate a hook so that any exception goes to `report` (counted, shown at the end) and the hook returns
    None: the forward it runs in goes on, its outputs untouched. `HSTAP_FAULT=raise-in-tap:N` raises inside the
    N-th guarded hook call (the guard's own test)."""

    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def guarded(*args, **kwargs) -> None:
            try:
                fault_point("raise-in-tap")
                hook(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 — the whole point: never raise into the engine
                report(exc)
            return None
        return guarded

    return wrap


class Fired:
    """How often each tap's hook ran, and how many prefill requests the capture saw.

    `modules` maps a tap name ("hidden.14", "teacher") to the module path its hook sits on, for the message."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = dict(modules)
        self.calls: Counter[str] = Counter()
        self.requests = 0

    def hit(self, name: str) -> None:
        self.calls[name] += 1

    def silent(self, finished: bool = False) -> list[str]:
        """Taps whose hook has not run once in `SILENT_AFTER` prefill requests (or in all of them, `finished`)."""
        if self.requests < SILENT_AFTER and not (finished and self.requests):
            return []
        return [name for name in self.modules if not self.calls[name]]

    def message(self, silent: list[str]) -> str:
        where = ", ".join(f"{self.modules[n]} ({n})" for n in silent)
        return (f"the capture hooks on {where} never fired in {self.requests} prefill requests, so nothing was "
                "captured: the model calls these modules' .forward() directly, which bypasses nn.Module.__call__ "
                "and its hooks (as SGLang issue 21686 found for NemotronH); capture needs the module called as "
                "module(x)")


def module_names(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """tap name -> the module's path in `model` (its class name when it is not a submodule)."""
    paths = {id(m): n for n, m in model.named_modules()}
    return {name: paths.get(id(m), type(m).__name__) for name, m in modules.items()}
