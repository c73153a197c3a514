"""block_topk equals torch.topk: values exactly, ids up to the order of ties, in every shape the runtime and the
teacher use it on (the tree drafter's (B, k, Vd) rows, a tail past the whole blocks, -inf, ties)."""

from __future__ import annotations

import pytest
import torch

from hstap.topk import block_topk


def _assert_like_topk(x: torch.Tensor, k: int, block: int) -> None:
    values, ids = block_topk(x, k, block)
    ref = x.topk(k, dim=-1)
    assert values.shape == ref.values.shape and ids.dtype == torch.long
    assert torch.equal(values, ref.values)  # the same numbers, sorted descending
    assert torch.equal(x.gather(-1, ids), values)  # each id holds its value
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an id repeated"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_in_the_tree_drafters_shapes(dtype):
    gen = torch.Generator().manual_seed(0)
    for shape, k, block in [((2, 8, 2048), 8, 128), ((3, 2048), 8, 128), ((2, 4, 1000), 4, 16), ((5, 1000), 8, 32)]:
        _assert_like_topk(torch.randn(*shape, generator=gen).to(dtype), k, block)


def test_adversarial_rows():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1000, generator=gen)  # 1000 = 62 blocks of 16 + an 8-column tail
    x[0, 32:36] = 9.0  # the whole top 4 in one block
    x[1, 995:] = 9.0  # in the tail
    x[2, ::16] = 5.0  # every block's max tied
    x[3] = 0.5  # the whole row tied
    x[4, 4:] = float("-inf")  # fewer finite values than k
    x[5, 100:200] = x[5].max()  # tied maxima over several blocks
    _assert_like_topk(x, 4, 16)
    values, ids = block_topk(x, 4, 16)
    assert sorted(ids[0].tolist()) == [32, 33, 34, 35] and (ids[1] >= 995).all()
    assert torch.isfinite(values[4]).all()  # exactly k finite values: all found
    _assert_like_topk(x[4:5], 6, 16)
    assert torch.isinf(block_topk(x[4:5], 6, 16)[0][0, 4:]).all()  # past them, -inf


def test_narrow_rows_take_plain_topk():
    x = torch.randn(3, 100)
    values, ids = block_topk(x, 8, 128)  # 2·8·128 > 100 columns
    assert torch.equal(values, x.topk(8).values) and torch.equal(ids, x.topk(8).indices)


def test_unsorted_gives_the_same_set_of_values_and_ids():
    """`sorted=False` (the tree's expansion, which ranks candidates itself): the same k values and ids as the sorted
    call, in some order, on both the blocked and the plain path."""
    gen = torch.Generator().manual_seed(2)
    for x, k, block in [(torch.randn(2, 8, 2048, generator=gen), 8, 128), (torch.randn(3, 100, generator=gen), 8, 128)]:
        values, ids = block_topk(x, k, block, sorted=False)
        ref_values, ref_ids = block_topk(x, k, block)
        assert torch.equal(x.gather(-1, ids), values)
        assert torch.equal(values.sort(-1, descending=True).values, ref_values)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
