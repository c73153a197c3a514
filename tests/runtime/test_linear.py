"""The runtime's projections (hstap.runtime.linear): oneDNN's reordered weights on a CPU at the row counts where
`choose_products` measured them faster (from four rows on before it measures), MKL elsewhere; both within fp32's
dot-product error bound of the exact product; one measured rule for the one-token step and verification blocks,
cached per weight shapes and thread count; the switch and a broken build fall back to F.linear; the real
SmolLM2's lean forward agrees with the copies on and off (speculative decoding's greedy identity with vanilla,
copies on by default, is tests/runtime/test_spec.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hstap.errors import HstapError
from hstap.runtime import linear
from hstap.runtime.kv import block_mask
from hstap.runtime.linear import (BEFORE_MEASURING, MEASURED_ROWS, PATHS, ProductChoice, Projection, choose_products,
                                  reorder_works)
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
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@torch.no_grad()
def test_every_path_is_exact_to_fp32(path, rows):
    """MKL, oneDNN at the input's rows, and oneDNN padded with zero rows to four (its extra rows dropped after)."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    proj = Projection(weight, bias, reorder=True)  # True: whatever HSTAP_CPU_REORDER the caller's shell has
    assert proj.reordered is not None and proj.extra_bytes == weight.numel() * 4
    assert proj.paths == BEFORE_MEASURING == ("mkl", "mkl", "mkl", "onednn")  # until choose_products measures
    x = torch.randn(rows, 2, 80, generator=g).transpose(0, 1)  # (2, rows, 80), not contiguous
    got = proj.through(path, x)
    assert got.shape == (2, rows, 96)
    within_fp32_bound(got, x, weight, bias)
    assert ("mkldnn::_linear_pointwise" in ops_run(lambda: proj.through(path, x))) == (path != "mkl")


@pytest.fixture(autouse=True)
def own_product_cache(tmp_path, monkeypatch):
    """Each test measures (or fakes a measurement) for itself: the machine's remembered choice stays out."""
    monkeypatch.setenv("HSTAP_CACHE", str(tmp_path / "cache"))


def measured(threads: int, per_shape: dict) -> ProductChoice:
    """A ProductChoice of given times: {weight shape: (mkl, onednn, padded) ms per row count}, one projection each."""
    return ProductChoice(threads, {shape: dict(zip(PATHS, times)) for shape, times in per_shape.items()},
                         dict.fromkeys(per_shape, 1))


@needs_onednn
@torch.no_grad()
def test_the_measured_path_is_taken_per_weight_shape_and_row_count(monkeypatch):
    """`choose_products` times every path at 1-4 rows and every projection takes the fastest for its weight's shape
    per row count, more rows taking the four-row choice: here padding for the larger weight at one row, plain
    oneDNN for the smaller, MKL for both at two rows, oneDNN at three and from four on."""
    g = torch.Generator().manual_seed(0)
    small, large = (Projection(torch.randn(n, 48, generator=g), reorder=True) for n in (64, 80))
    times = measured(torch.get_num_threads(), {
        (64, 48): ((9.0, 1.0, 9.0, 9.0), (2.0, 2.0, 2.0, 2.0), (3.0, 3.0, 3.0, None)),
        (80, 48): ((9.0, 1.0, 9.0, 9.0), (3.0, 2.0, 2.0, 2.0), (2.5, 3.0, 3.0, None))})
    monkeypatch.setattr(linear, "_CHOICES", {})
    monkeypatch.setattr(linear, "_measure", lambda copied, rounds: times)
    assert choose_products([small, large]) is times
    assert small.paths == ("onednn", "mkl", "onednn", "onednn")
    assert large.paths == ("padded", "mkl", "onednn", "onednn")
    for p in (small, large):
        for rows, onednn in [(1, True), (2, False), (3, True), (4, True), (9, True)]:
            x = torch.randn(rows, 48, generator=g)
            assert ("mkldnn::_linear_pointwise" in ops_run(lambda p=p, x=x: p(x))) == onednn, rows
            within_fp32_bound(p(x), x, p.weight, None)
    described = times.describe()
    assert described.startswith(f"CPU fp32 products measured at {times.threads} threads")
    assert "1 row 4.5 ms (onednn ×1, padded ×1; all through mkl 18.0, onednn 5.0, padded 5.5)" in described
    assert "2 rows 2.0 ms (mkl ×2; all through" in described and "4+ rows 4.0 ms (onednn ×2; all through mkl " \
        "18.0, onednn 4.0)" in described


@needs_onednn
@torch.no_grad()
def test_the_choice_is_measured_once_per_weight_shapes_and_thread_count(monkeypatch):
    monkeypatch.setattr(linear, "_CHOICES", {})
    g = torch.Generator().manual_seed(1)
    first = [Projection(torch.randn(40, 24, generator=g), torch.randn(40, generator=g), reorder=True)]
    choice = choose_products(first)  # a real measurement: a time per path and row count
    table = choice.ms[(40, 24)]
    assert [len(table[p]) for p in PATHS] == [len(MEASURED_ROWS)] * 3 and choice.count == {(40, 24): 1}
    assert all(ms > 0 for p in PATHS for ms in table[p][:3]) and table["padded"][3] is None
    assert first[0].paths == choice.paths_for((40, 24)) and set(first[0].paths) <= set(PATHS)
    same_shapes = [Projection(torch.randn(40, 24, generator=g), reorder=True)]
    assert choose_products(same_shapes) is choice and same_shapes[0].paths == first[0].paths
    assert choose_products([Projection(torch.randn(40, 24, generator=g), reorder=False)]) is None  # nothing to time
    before = torch.get_num_threads()
    torch.set_num_threads(2 if before == 1 else 1)
    try:
        assert choose_products(first) is not choice  # another thread count is measured again
    finally:
        torch.set_num_threads(before)


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
    assert off.reordered_bytes == 0 and off.products is None
    assert all(p.paths == on.products.paths_for(tuple(p.weight.shape)) for p in on.projections)  # one rule
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


@needs_onednn
@torch.no_grad()
def test_one_token_steps_take_the_product_measured_for_one_row(target, monkeypatch):
    """Vanilla decoding's one-token step follows the rule a verification block follows: oneDNN's copies where one
    row measured faster through them, MKL where it did not (the step used to stay on MKL whatever was measured)."""
    from hstap.runtime.target import Runtime

    prompt = torch.tensor([target.tokenizer("The capital of France is")["input_ids"]])
    try:
        for one_row_mkl_ms in (9.0, 1.0):  # oneDNN's 5 ms faster at one row, then slower
            row_times = ((one_row_mkl_ms, 9.0, 9.0, 9.0), (5.0,) * 4, (6.0,) * 3 + (None,))
            shapes = {tuple(p.weight.shape) for p in LeanLlama(target.model, reorder=False).projections}
            times = measured(torch.get_num_threads(), dict.fromkeys(shapes, row_times))
            monkeypatch.setattr(linear, "_CHOICES", {})
            monkeypatch.setattr(linear, "_measure", lambda copied, rounds, times=times: times)
            monkeypatch.setattr(linear, "_remembered", lambda key, measure: measure())  # not this machine's file
            rt = Runtime(target.model, batch_size=1, max_len=64, reorder=True)
            rt.prefill(prompt, torch.ones_like(prompt), 4)
            step = ops_run(lambda rt=rt: rt.step(torch.tensor([42])))
            assert ("mkldnn::_linear_pointwise" in step) == (one_row_mkl_ms > 5.0)
            with torch.inference_mode():  # the cache's tensors are inference tensors
                block = ops_run(lambda rt=rt: rt.block(rt.slot, torch.tensor([[1, 2, 3, 4]]), torch.arange(4),
                                                       torch.ones(4, 4, dtype=torch.bool).tril()))
            assert "mkldnn::_linear_pointwise" in block  # four rows: oneDNN in both
    finally:
        monkeypatch.undo()
        LeanLlama(target.model, reorder=True)  # the shared weights follow this process's real measurement again


def test_the_measured_choice_is_kept_on_disk_until_the_machine_reboots(tmp_path, monkeypatch):
    """Every process building a runtime would measure again (~1-2 s each): the choice is read back from the cache
    dir, under a name that holds the shapes, threads, torch, CPU model and boot id; a damaged file is measured
    again and rewritten."""
    monkeypatch.setenv("HSTAP_CACHE", str(tmp_path))
    times = measured(2, {(576, 576): ((1.0, 2.0, 3.0, 4.0), (5.0,) * 4, (6.0,) * 3 + (None,))})
    calls = []

    def measure():
        calls.append(1)
        return times

    key = (((576, 576),), 2)
    first = linear._remembered(key, measure)
    again = linear._remembered(key, measure)
    assert calls == [1] and again == first == times
    (file,) = (tmp_path / "products").iterdir()
    file.write_text("{not json")
    assert linear._remembered(key, measure) == times and calls == [1, 1]
    assert linear._remembered((((576, 576),), 1), measure) == times and calls == [1, 1, 1]  # another thread count
