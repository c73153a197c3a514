"""bench/verify_cost.py's elementwise census: which layout class each op of a body falls in (a slice of a
dense-but-permuted tensor along its outer dim is dense; against a contiguous operand it is strided)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _verify_cost():
    spec = importlib.util.spec_from_file_location("bench_verify_cost", ROOT / "bench" / "verify_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_census_tells_contiguous_broadcast_and_strided_ops_apart():
    census = _verify_cost().elementwise_census
    a, row = torch.randn(4, 6), torch.randn(6)
    both = torch.randn(4, 12)
    gate, up = both.chunk(2, dim=-1)  # the MLP's halves: strided from two rows on

    heads_first = torch.randn(3, 4, 5).permute(1, 0, 2)  # dense, in another dim order

    counts = census(lambda: (a + a, a * row, F.silu(gate) * up, both[:1].chunk(2, -1)[0] * 2, a.t().clone(),
                             heads_first[:, 1:] + heads_first[:, 1:], heads_first + torch.randn(4, 3, 5)))
    assert counts == {("add", "dense"): 2, ("mul", "broadcast"): 1, ("silu", "strided"): 1, ("mul", "strided"): 1,
                      ("mul", "dense"): 1, ("clone", "dense"): 1, ("add", "strided"): 1}
