"""bench/verify_cost.py's section 6: every KV write form it times leaves the cache the runtime's own write leaves
(its elementwise census, section 4, is hstap.runtime.census, tested with the runtime)."""

from __future__ import annotations

import torch

import verify_cost
from hstap.runtime.kv import KVCache


def test_every_kv_write_form_leaves_the_cache_the_runtimes_write_leaves():
    """Section 6's forms, two rows writing different columns (the bench times one row): a wrong row, head or
    column offset in the flat index puts a key in another place and fails the equality."""
    torch.manual_seed(0)
    kv = KVCache(2, 2, 3, 16, 4, torch.float32, torch.device("cpu"))
    cols = torch.tensor([[5, 6, 7], [9, 10, 11]])
    k = torch.randn(3, 2, 3, 4).permute(1, 0, 2, 3)  # (B, H_kv, Q, D), heads first in memory like rotary_qk's
    v = torch.randn(2, 3, 9, 4)[:, :, 6:].transpose(1, 2)  # a strided slice of qkv rows
    written = {}
    for name, form in verify_cost.kv_write_forms(kv, cols, k, v).items():
        kv.data.zero_()
        form()
        written[name] = kv.data.clone()
    assert set(written) == {"scatter", "index_copy", "index_put"}
    for name, data in written.items():
        assert torch.equal(data, written["scatter"]), name
    assert torch.equal(written["scatter"][0, 1, :, 9:12], k[1]) and torch.equal(written["scatter"][1, 0, :, 5:8], v[0])
    assert not written["scatter"][2:].any(), "layer 0 only"
