"""hstap.runtime.census: which layout class each elementwise op of a body falls in (a slice of a dense-but-permuted
tensor along its outer dim is dense; against a contiguous operand it is strided)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstap.runtime.census import elementwise_census, layout_of


def test_the_census_tells_contiguous_broadcast_and_strided_ops_apart():
    a, row = torch.randn(4, 6), torch.randn(6)
    both = torch.randn(4, 12)
    gate, up = both.chunk(2, dim=-1)  # the MLP's halves: strided from two rows on

    heads_first = torch.randn(3, 4, 5).permute(1, 0, 2)  # dense, in another dim order

    counts = elementwise_census(lambda: (a + a, a * row, F.silu(gate) * up, both[:1].chunk(2, -1)[0] * 2,
                                         a.t().clone(), heads_first[:, 1:] + heads_first[:, 1:],
                                         heads_first + torch.randn(4, 3, 5)))
    assert counts == {("add", "dense"): 2, ("mul", "broadcast"): 1, ("silu", "strided"): 1, ("mul", "strided"): 1,
                      ("mul", "dense"): 1, ("clone", "dense"): 1, ("add", "strided"): 1}


def test_a_layout_is_dense_only_when_every_operand_fills_memory_in_the_same_order():
    x = torch.randn(4, 6)
    assert layout_of([x, x.clone()]) == "dense"
    assert layout_of([x.t(), x.t().contiguous()]) == "strided"  # both without gaps, in two dim orders
    assert layout_of([x[:, :3], torch.randn(4, 3)]) == "strided"  # a gap after every row
    assert layout_of([x, torch.randn(6)]) == "broadcast"
    assert layout_of([x.t(), x.t()]) == "dense"  # one order, however permuted
