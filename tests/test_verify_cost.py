"""bench/verify_cost.py's elementwise census: which layout class each op of a body falls in (a slice of a
dense-but-permuted tensor along its outer dim is dense; against a contiguous operand it is strided)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.bench_scripts import bench_script


def _verify_cost():
    return bench_script("verify_cost")


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


def test_every_kv_write_form_leaves_the_cache_the_runtimes_write_leaves():
    """Section 6's forms, two rows writing different columns (the bench times one row): a wrong row, head or
    column offset in the flat index puts a key in another place and fails the equality."""
    from hstap.runtime.kv import KVCache

    torch.manual_seed(0)
    kv = KVCache(2, 2, 3, 16, 4, torch.float32, torch.device("cpu"))
    cols = torch.tensor([[5, 6, 7], [9, 10, 11]])
    k = torch.randn(3, 2, 3, 4).permute(1, 0, 2, 3)  # (B, H_kv, Q, D), heads first in memory like rotary_qk's
    v = torch.randn(2, 3, 9, 4)[:, :, 6:].transpose(1, 2)  # a strided slice of qkv rows
    written = {}
    for name, form in _verify_cost().kv_write_forms(kv, cols, k, v).items():
        kv.data.zero_()
        form()
        written[name] = kv.data.clone()
    assert set(written) == {"scatter", "index_copy", "index_put"}
    for name, data in written.items():
        assert torch.equal(data, written["scatter"]), name
    assert torch.equal(written["scatter"][0, 1, :, 9:12], k[1]) and torch.equal(written["scatter"][1, 0, :, 5:8], v[0])
    assert not written["scatter"][2:].any(), "layer 0 only"
