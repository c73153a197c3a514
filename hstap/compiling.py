"""torch.compile with a way back, for the training step's compiled pieces (the head loss's block, the TTT
diagonal merge): the first failure is said once on stderr and every later call takes the eager form, so a
compiler that breaks costs speed, never a training run.

    BLOCK = CompiledOr(block_numbers, "head loss", "the eager one")
    loss = BLOCK((logits, ids), lambda: block_numbers_inplace(logits, ids))
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch

from hstap.errors import first_line

T = TypeVar("T")


class CompiledOr:
    """`fn` through torch.compile (dynamic shapes), compiled on first use; `eager()` from its first failure on."""

    def __init__(self, fn: Callable[..., T], what: str, instead: str):
        self.fn, self.what, self.instead = fn, what, instead
        self.failure = ""  # the compile error's first line, once one happened
        self._compiled: Callable[..., T] | None = None

    def __call__(self, args: tuple, eager: Callable[[], T]) -> T:
        if not self.failure:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.fn, dynamic=True)
                return self._compiled(*args)
            except Exception as e:  # noqa: BLE001 — a compiler failure must not end a training run: say so, go on
                self.failure = first_line(e)
                print(f"hstap: the compiled {self.what} failed ({self.failure}); continuing with {self.instead}",
                      file=sys.stderr)
        return eager()
