"""The runtime's projections (hstap.runtime.linear): oneDNN's reordered weights on a CPU from four rows on, MKL
below; both within fp32's dot-product error bound of the exact product; the switch and a broken build fall back
to F.linear; the real SmolLM2's lean forward agrees with the copies on and off (speculative decoding's greedy
identity with vanilla, copies on by default, is tests/runtime/test_spec.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hstap.errors import HstapError
from hstap.runtime import linear
from hstap.runtime.kv import block_mask
from hstap.runtime.linear import REORDERED_FROM_ROWS, Projection, reorder_works
from hstap.runtime.llama import LeanLlama

needs_onednn = pytest.mark.skipif(reorder_works() is not None, reason=f"oneDNN unusable: {reorder_works()}")


def ops_run(fn) -> set[str]:
    """The operator names `fn()` dispatched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def within_fp32_bound(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|got − exact| ≤ K·u·(|x|·|W|ᵀ + |b|), fp32's worst-case bound for a K-term dot product (u = 2⁻²⁴): a wrong
    layout or a lower-precision product misses it by orders of magnitude."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = F.linear(x.abs().double(), weight.abs().double(), None if bias is None else bias.abs().double())
    assert ((got.double() - exact).abs() <= x.shape[-1] * 2 ** -24 * scale).all()


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@torch.no_grad()
def test_products_are_exact_to_fp32_and_reordered_from_four_rows(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    proj = Projection(weight, bias, reorder=True)  # True: whatever HSTAP_CPU_REORDER the caller's shell has
    assert proj.reordered is not None and proj.extra_bytes == weight.numel() * 4
    x = torch.randn(rows, 2, 80, generator=g).transpose(0, 1)  # (2, rows, 80), not contiguous
    got = proj(x)
    assert got.shape == (2, rows, 96)
    within_fp32_bound(got, x, weight, bias)
    onednn = "mkldnn::_linear_pointwise" in ops_run(lambda: proj(x))
    assert onednn == (2 * rows >= REORDERED_FROM_ROWS)  # 2 × 1 rows: MKL; 2 × 3 rows and more: oneDNN


@torch.no_grad()
def test_no_copy_off_the_cpu_fp32_path_or_when_switched_off(monkeypatch):
    weight = torch.randn(16, 8)
    assert Projection(weight.bfloat16()).reordered is None  # fp32 only: the measured case
    assert Projection(weight, reorder=False).reordered is None
    monkeypatch.setenv("HSTAP_CPU_REORDER", "0")
    proj = Projection(weight)
    assert proj.reordered is None and proj.extra_bytes == 0
    x = torch.randn(5, 8)
    assert torch.equal(proj(x), F.linear(x, weight))
    monkeypatch.setenv("HSTAP_CPU_REORDER", "yes")
    with pytest.raises(HstapError, match="HSTAP_CPU_REORDER must be 0 or 1, got 'yes'"):
        Projection(weight)


@torch.no_grad()
def test_a_build_without_working_ops_is_said_once_and_falls_back(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    reorder_works.cache_clear()
    try:
        weight = torch.randn(16, 8)
        first, second = Projection(weight, reorder=True), Projection(weight, reorder=True)
        assert first.reordered is None and second.reordered is None
        x = torch.randn(6, 8)
        assert torch.equal(first(x), F.linear(x, weight))
        err = capsys.readouterr().err
        assert err.count("CPU products stay on F.linear") == 1 and "built without oneDNN" in err
    finally:
        monkeypatch.undo()
        linear.reorder_works.cache_clear()
    assert reorder_works() is None or "oneDNN" in reorder_works()


@needs_onednn
@torch.no_grad()
def test_smollm2_lean_forward_agrees_with_and_without_the_copies(target):
    """The real SmolLM2 in fp32: a 300-token prefill and a 4-token block (what verifies chain:3) give the same
    logits and next tokens through oneDNN's copies as through MKL, to fp32 rounding."""
    on, off = LeanLlama(target.model, reorder=True), LeanLlama(target.model, reorder=False)
    assert on.reordered_bytes > 0.9 * sum(p.numel() * 4 for p in target.model.parameters())
    assert off.reordered_bytes == 0
    torch.manual_seed(0)
    ids = torch.randint(0, on.vocab_size, (1, 304))
    logits = {}
    for name, lean in (("on", on), ("off", off)):
        kv = lean.new_cache(1, 320)
        cols = torch.arange(304).unsqueeze(0)
        zero, at = torch.zeros(1, dtype=torch.long), torch.full((1,), 300)
        causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in (300, 4)]
        prefill, _ = lean.forward(ids[:, :300], cols[:, :300], kv, cols[:, :300],
                                  block_mask(zero, zero, 320, causal[0], torch.float32))
        block, _ = lean.forward(ids[:, 300:], cols[:, 300:], kv, cols[:, 300:],
                                block_mask(zero, at, 320, causal[1], torch.float32))
        logits[name] = torch.cat([prefill, block], 1)
    torch.testing.assert_close(logits["on"], logits["off"], rtol=1e-4, atol=1e-3)  # logits reach ~30
    assert torch.equal(logits["on"].argmax(-1), logits["off"].argmax(-1))
