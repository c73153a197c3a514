"""The cheap top-k teacher equals log_softmax → topk: on random logits with ties and -inf, in every float dtype and
across row blocks, and on the real SmolLM2's logits."""

from __future__ import annotations

import pytest
import torch

from hstap.capture.teacher import BLOCK, topk_logprobs


def _assert_same_topk(logits: torch.Tensor, k: int, chunk_bytes: int, atol: float = 2e-6, block: int = BLOCK) -> None:
    """Against log_softmax → topk in fp64 (exact for fp32 results): fp32's own log_softmax is off by 2.2e-5 on
    SmolLM2's logits (its 49,152-term sum), the chunked sum by 4e-7 (docs/benchmarks.md)."""
    values, ids = topk_logprobs(logits, k, chunk_bytes=chunk_bytes, block=block)
    ref = torch.log_softmax(logits.double(), dim=-1)  # (..., V)
    ref_values = ref.topk(k, dim=-1).values.float()
    assert values.dtype == torch.float32 and ids.dtype == torch.long and values.shape == ref_values.shape
    torch.testing.assert_close(values, ref_values, atol=atol, rtol=0)
    # ids: tied logits may come back in another order, so check what each id means, not its position
    torch.testing.assert_close(ref.gather(-1, ids).float(), ref_values, atol=atol, rtol=0)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an id repeated"
    fp32 = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1).values  # what the tap stored before
    torch.testing.assert_close(values, fp32, atol=5e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_logits_with_ties_and_minus_inf(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (6 * torch.randn(4, 5, 300, generator=gen)).to(dtype)  # (B, S, V)
    logits[0, 0, :200] = float("-inf")  # a masked vocabulary slice
    logits[0, 1, 250:] = float("-inf")
    logits[1, 0] = 3.0  # one row all tied
    logits[2, 2, 40:80] = logits[2, 2].max()  # 40 tied maxima: more than k
    logits[3, 3, ::7] = logits[3, 3].max() - 0.5  # ties below the max
    for rows in (20, 3, 1):  # one block, ragged blocks, a row at a time
        _assert_same_topk(logits, 32, chunk_bytes=4 * 300 * rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_from_the_best_blocks(dtype):
    """The block path (V ≥ 2·k·block): 8-column blocks, k = 4, V = 300 (a 4-column tail past the 37 whole
    blocks), rows built so the answer sits where a wrong candidate set would miss it."""
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(9, 300, generator=gen)).to(dtype)
    logits[0, 8:12] = 50.0  # the whole top 4 inside one block
    logits[1, [3, 100, 200, 290]] = torch.tensor([40.0, 41.0, 42.0, 43.0]).to(dtype)  # one per block
    logits[2, 297] = 60.0  # the max in the tail
    logits[2, 296:300] = torch.tensor([55.0, 60.0, 58.0, 57.0]).to(dtype)  # the whole top 4 in the tail
    logits[3, 16:24] = logits[3].max()  # block maxima tied with each other ...
    logits[3, 64:72] = logits[3].max()  # ... across blocks: equal values, any of their ids
    logits[4, 2:] = float("-inf")  # two finite logits for k = 4: the top-k ends in -inf
    logits[5] = 1.0  # all tied
    logits[6, :296] = float("-inf")  # only the tail is finite
    logits[7, ::8] = 30.0  # every block's max tied, the rest below
    for rows in (9, 2, 1):
        _assert_same_topk(logits, 4, chunk_bytes=4 * 300 * rows, block=8)
    values, ids = topk_logprobs(logits, 4, block=8)
    assert sorted(ids[0].tolist()) == [8, 9, 10, 11] and sorted(ids[2].tolist()) == [296, 297, 298, 299]
    assert ids[1].tolist() == [290, 200, 100, 3]
    assert torch.isfinite(values[4, :2]).all() and torch.isinf(values[4, 2:]).all()
    assert (ids[6] >= 296).all() and torch.isfinite(values[6]).all()


def test_more_inf_than_k_leaves_minus_inf_entries():
    logits = torch.full((1, 10), float("-inf"))
    logits[0, 3], logits[0, 7] = 1.0, 2.0
    values, ids = topk_logprobs(logits, 4)
    assert ids[0, :2].tolist() == [7, 3]
    assert torch.isinf(values[0, 2:]).all() and torch.allclose(values[0, :2].exp().sum(), torch.tensor(1.0))


def test_real_smollm2_logits(target):
    """The shapes capture sees: SmolLM2's 49,152-token vocabulary, its logits in fp32 and rounded to bf16 (what a
    bf16 target hands the tap); the stored fp16 values equal the reference's to one fp16 rounding."""
    ids = target.tokenizer("Speculative decoding drafts tokens and the target verifies them in one forward pass.",
                           return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = target.model(input_ids=ids).logits[0]  # (S, V) fp32
    for dtype in (torch.float32, torch.bfloat16):
        _assert_same_topk(logits.to(dtype), 32, chunk_bytes=4 * logits.shape[-1] * 5)
    values, _ = topk_logprobs(logits.to(torch.bfloat16), 32)
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).topk(32, -1).values
    torch.testing.assert_close(values.half(), ref.half(), atol=2e-3, rtol=1e-3)  # fp16 steps of log-probs ~ -10


@pytest.mark.gpu
def test_cuda_compiled_reduction_equals_the_reference():
    """On CUDA the log-sum-exp is one compiled reduction (dynamic row counts): two row counts, bf16 logits of an
    8B target's vocabulary, against the fp64 reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (300, 77):
        logits = (4 * torch.randn(rows, 128256, device="cuda", generator=gen)).to(torch.bfloat16)
        logits[0, :1000] = float("-inf")
        _assert_same_topk(logits, 32, chunk_bytes=0)


def test_compile_failure_falls_back_to_the_eager_step(monkeypatch):
    """On CUDA both steps are compiled; a toolchain that cannot compile costs a warning, not the teacher."""
    from hstap.capture import teacher

    def broken(fn):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(teacher, "_compiled", broken)
    monkeypatch.setattr(teacher, "_EAGER_ONLY", [])
    x = torch.randn(3, 40)
    with pytest.warns(UserWarning, match="compiled topk_in_best_blocks unavailable"):
        got = teacher._compiled_or(teacher.topk_in_best_blocks, (x, x[:, :40].view(3, 5, 8).amax(-1), 2, 8),
                                   lambda: "eager")
    assert got == "eager" and teacher._EAGER_ONLY  # and eager from then on, without trying again
    assert teacher._compiled_or(teacher._stats, (x,), lambda: "eager again") == "eager again"
