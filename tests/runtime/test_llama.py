"""LeanLlama's two MLP forms (hstap.runtime.llama.gated_mlp) on the real SmolLM2 in fp32: both give transformers'
MLP, the batched one (CUDA's) keeps every elementwise op dense at any block width, and a whole prefill through
either form gives the same logits. The CPU runs the chunk form by default, so without these tests the form the
H200 decodes with would be exercised by the GPU tests only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hstap.errors import HstapError
from hstap.runtime.decode import left_pad
from hstap.runtime.kv import KV_WRITES
from hstap.runtime.llama import LeanLlama, gated_mlp, mlp_form_for
from hstap.runtime.census import elementwise_census
from hstap.runtime.target import Runtime


@pytest.fixture(scope="module")
def forms(target) -> dict[str, LeanLlama]:
    return {form: LeanLlama(target.model, form, reorder=False) for form in ("chunk", "batched")}  # MKL as transformers


@pytest.mark.parametrize("rows", [1, 4])
@torch.no_grad()
def test_both_forms_are_as_close_to_exact_as_transformers_mlp(target, forms, rows):
    """Against the MLP in float64: each form's fp32 error is within twice transformers' own (outputs reach ~700,
    where an fp32 ulp is 6e-5, so a fixed atol would say nothing); a wrong weight or half is off by O(1)."""
    torch.manual_seed(0)
    hidden = target.model.config.hidden_size
    x = torch.randn(2, rows, hidden)
    mlp = target.model.model.layers[3].mlp
    exact = F.linear(F.silu(F.linear(x.double(), mlp.gate_proj.weight.double()))
                     * F.linear(x.double(), mlp.up_proj.weight.double()), mlp.down_proj.weight.double())
    bound = 2 * (mlp(x).double() - exact).abs().max()
    for form, lean in forms.items():
        got = gated_mlp(lean.layers[3], x)
        assert got.shape == (2, rows, hidden) and got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= bound, form
    assert forms["batched"].layers[3].gate_up is None, "one copy of the gate/up weights per form"


def test_the_batched_form_is_dense_at_every_width(forms):
    def strided(form: str, queries: int) -> int:
        x = torch.randn(1, queries, forms[form].layers[0].ln1.shape[0])
        counts = elementwise_census(lambda: gated_mlp(forms[form].layers[0], x))
        return sum(n for (_, layout), n in counts.items() if layout != "dense")

    assert [strided("batched", q) for q in (1, 4, 16)] == [0, 0, 0]
    assert strided("chunk", 4) == 2, "the chunk form's silu and product read half-rows from two rows on"


def test_a_prefill_through_either_form_gives_the_same_logits(target, prompts):
    ids, mask = left_pad([prompts[0][:11], prompts[1][:7]], target.tokenizer.pad_token_id, "cpu")
    logits = {}
    for form in ("chunk", "batched"):
        rt = Runtime(target.model, batch_size=2, max_len=32, cuda_graphs=False, len_bucket=16, mlp_form=form)
        assert rt.lean.mlp_form == form
        logits[form], _ = rt.prefill(ids, mask, 4)
    torch.testing.assert_close(logits["batched"], logits["chunk"], atol=2e-4, rtol=1e-4)


def test_the_index_copy_kv_write_fills_the_cache_as_the_scatter_does(target, prompts):
    """Both KV write forms (hstap.runtime.kv.KVCache) through a two-row left-padded prefill: the same cache bit
    for bit and the same logits, so a wrong row, head or column in the flat index cannot hide."""
    ids, mask = left_pad([prompts[0][:11], prompts[1][:7]], target.tokenizer.pad_token_id, "cpu")
    logits, caches = {}, {}
    for form in KV_WRITES:
        rt = Runtime(target.model, batch_size=2, max_len=32, cuda_graphs=False, len_bucket=16, kv_write=form)
        assert rt.slot is None and rt.lean.new_cache(1, 4).write_form == form
        logits[form] = rt.prefill(ids, mask, 4)
        caches[form] = rt.slot.kv.data.clone()
    assert caches["index_copy"].abs().sum() > 0
    assert torch.equal(caches["index_copy"], caches["scatter"])
    assert torch.equal(logits["index_copy"], logits["scatter"])
    with pytest.raises(ValueError, match="kv_write must be one of scatter, index_copy, got 'put'"):
        LeanLlama(target.model, kv_write="put")


def test_the_form_follows_the_device_and_bad_forms_are_one_line(target):
    assert mlp_form_for(torch.device("cuda"), has_bias=False) == "batched"
    assert mlp_form_for(torch.device("cuda"), has_bias=True) == "chunk"
    assert mlp_form_for(torch.device("cpu"), has_bias=False) == "chunk"
    assert LeanLlama(target.model).mlp_form == "chunk"  # the CPU's
    with pytest.raises(ValueError, match="mlp_form must be one of chunk, batched or None, got 'fused'"):
        LeanLlama(target.model, "fused")
    with pytest.raises(HstapError, match="batched MLP form has no bias"):
        LeanLlama._fuse(_biased_layer(target), 9, 3, "batched", None)


def _biased_layer(target):
    """A copy of layer 0 whose gate projection has a bias (Llama's `mlp_bias=True`)."""
    import copy

    layer = copy.deepcopy(target.model.model.layers[0])
    layer.mlp.gate_proj.bias = torch.nn.Parameter(torch.zeros(layer.mlp.gate_proj.out_features))
    return layer


@torch.no_grad()
def test_fused_weights_are_made_once_per_model_and_again_after_a_weight_changes(target):
    """Runtimes over one model share its fused (and on a CPU reordered) weights; an in-place update of a weight
    makes them again, so a forward never multiplies by a stale copy."""
    model = target.model
    first, second = LeanLlama(model, reorder=True), LeanLlama(model, reorder=True)
    assert first.layers is second.layers and first.lm_head is second.lm_head
    if first.reordered_bytes:  # oneDNN works here: the copies are part of the key
        assert LeanLlama(model, reorder=False).layers is not first.layers
    q = model.model.layers[2].self_attn.q_proj.weight
    saved = q.clone()
    x = torch.randn(5, q.shape[1])
    try:
        q.mul_(2)
        changed = LeanLlama(model, reorder=True)
        assert changed.layers is not first.layers
        rows = q.shape[0]
        close = dict(rtol=1e-4, atol=1e-4)  # two GEMM libraries' fp32 rounding; a stale weight is off by 2x
        torch.testing.assert_close(changed.layers[2].qkv(x)[:, :rows], F.linear(x, q), **close)  # 5 rows: oneDNN
        torch.testing.assert_close(first.layers[2].qkv(x)[:, :rows], F.linear(x, saved), **close)  # its own copy
    finally:
        q.copy_(saved)
    assert LeanLlama(model, reorder=True).layers is not first.layers  # restored in place: a new version
