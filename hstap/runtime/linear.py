"""The runtime's projections (a weight and its bias) and, on a CPU, oneDNN's blocked copy of the weight for
products of four rows or more.

A decoding forward streams every weight from memory once, so a 4-token verification should cost about what a
1-token step does. On a CPU it did not: PyTorch's default fp32 GEMM (MKL) repacks the weight on every call from
four rows on, and a chain:3 verification cost 1.57 decoding steps (1.26 through the copies below; 2-core AMD
EPYC VM, torch 2.13, SmolLM2 in fp32, `bench/forward_cost.py --reorder on off`, 2026-12-05). oneDNN multiplies
by a copy reordered once into its blocked layout: SmolLM2's 121 projections streamed at 4 rows took 29.6 ms
instead of 40.8, at 8 rows 33.7 instead of 52.2, at a 300-token prefill 237 instead of 252; at one to three rows
it is 15-22 % slower than MKL (26.8 against 21.9 ms at one row: `bench/cpu_gemm.py`, same VM and day), so those
products keep MKL, and vanilla decoding, the speedups' baseline, is what it was.

The copy costs the weights' bytes once more (538 MB for SmolLM2 in fp32). It is made for fp32 CPU weights when
PyTorch was built with oneDNN (`reorder=None`, the default; `HSTAP_CPU_REORDER=0` turns the default off, for
memory or an A/B) and checked against `F.linear` once per process: a build whose ops are missing or disagree is
said once and every product stays on `F.linear`.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

from hstap.errors import HstapError

REORDERED_FROM_ROWS = 4  # products of fewer rows run MKL (measured faster there, module docstring)


def _reordered(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` (N, K), laid out for products of four rows; any row count multiplies by
    it. Laid out for one row instead, 2 to 8 rows ran 28-37 % slower (`bench/cpu_gemm.py --reorder-hint 1`,
    2-core EPYC, 2026-12-05)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, REORDERED_FROM_ROWS)


def _onednn_linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) · Wᵀ + b through oneDNN, W given as `_reordered(W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


@functools.cache
def reorder_works() -> str | None:
    """None when oneDNN's reordered products work in this process (checked once on a small product), else why
    not (said once on stderr)."""
    reason = None
    if not torch.backends.mkldnn.is_available():
        reason = "PyTorch was built without oneDNN"
    else:
        try:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(40, 24, generator=generator)
            bias = torch.randn(40, generator=generator)
            x = torch.randn(2, 5, 24, generator=generator)
            got = _onednn_linear(x, _reordered(weight), bias)
            if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5):
                reason = "its products differ from F.linear's"
        except (RuntimeError, AttributeError) as err:  # an op this build lacks or refuses
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if reason is not None:
        print(f"hstap: CPU products stay on F.linear: oneDNN's reordered weights are unusable ({reason})",
              file=sys.stderr)
    return reason


def wants_reorder(weight: torch.Tensor, reorder: bool | None) -> bool:
    """Whether `weight` gets a reordered copy: `reorder` True/False forces it (True still needs a CPU fp32 weight
    and a working oneDNN), None means yes for fp32 weights on a CPU unless `HSTAP_CPU_REORDER` is 0."""
    if reorder is None:
        switch = os.environ.get("HSTAP_CPU_REORDER", "1")
        if switch not in ("0", "1"):
            raise HstapError(f"HSTAP_CPU_REORDER must be 0 or 1, got {switch!r}")
        reorder = None if switch == "1" else False
    if reorder is False or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return reorder_works() is None


class Projection:
    """x ↦ x·Wᵀ + b. `reordered`: oneDNN's copy of W, used for inputs of `REORDERED_FROM_ROWS` rows or more."""

    __slots__ = ("weight", "bias", "reordered")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, reorder: bool | None = None):
        self.weight, self.bias = weight, bias
        self.reordered = _reordered(weight) if wants_reorder(weight, reorder) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) → (..., N)."""
        if self.reordered is not None and x.numel() >= REORDERED_FROM_ROWS * x.shape[-1]:
            return _onednn_linear(x, self.reordered, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def extra_bytes(self) -> int:
        """Bytes the reordered copy holds (0 without one)."""
        return 0 if self.reordered is None else self.reordered.numel() * self.reordered.element_size()
