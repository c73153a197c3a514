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

try:  # Triton, for the hand-written kernels; absent where it is not installed (`triton_available()` says so)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CUDA builds of torch ship Triton, the test environment installs it
    triton = tl = None

T = TypeVar("T")


def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch; the CPU test environment installs it)."""
    return tl is not None


def triton_jit(fn):
    """triton.jit where Triton is installed (the function as it is elsewhere). TRITON_INTERPRET=1, set before
    Triton is first imported, makes interpreted kernels that run on a CPU (the tests' child processes)."""
    return triton.jit(fn) if triton is not None else fn


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


class Kernels:
    """Hand-written (Triton) kernels with a way back: checked once per process against their PyTorch forms on the
    device, the first failure or disagreement said once on stderr, the caller's other path from then on.

        MERGE = Kernels("Triton TTT merge kernels", "the compiled merge", check, triton_available)
        if MERGE.usable(q.device):                                   # else the other path
            out = MERGE.call(kernel, args, lambda: other(*args))    # a call that fails: said once, `other` after
    """

    def __init__(self, what: str, instead: str, check: Callable[[torch.device], None],
                 available: Callable[[], bool]):
        self.what, self.instead, self._check, self._available = what, instead, check, available
        self.enabled = True  # False: never used (bench/train_throughput.py times both paths)
        self.checked = False
        self.failure = ""  # why they were turned off ('' while they are on)

    def turn_off(self, why: str) -> None:
        if not self.failure:
            self.failure = why
            print(f"hstap: {self.what} off ({why}); continuing with {self.instead}", file=sys.stderr)

    def usable(self, device: torch.device) -> bool:
        """Whether they run here: enabled, Triton installed, and (once per process) equal to their PyTorch forms
        on `device` (`check` raises otherwise)."""
        if not (self.enabled and self._available()):
            return False
        if not self.checked:
            self.checked = True
            try:
                self._check(device)
            except Exception as e:  # noqa: BLE001 — a compiler or a kernel that fails must not end a training run
                self.turn_off(first_line(e)[:300])
        return not self.failure

    def call(self, kernel: Callable[..., T], args: tuple, instead: Callable[[], T], where: str = "") -> T:
        """kernel(*args) while the kernels are on; a call that raises turns them off (said once, `where` before
        the error's first line) and `instead()` answers it and every later call."""
        if not self.failure:
            try:
                return kernel(*args)
            except Exception as e:  # noqa: BLE001 — e.g. a shape the check did not compile: the other path from now
                self.turn_off(f"{where}{first_line(e)}"[:300])
        return instead()
