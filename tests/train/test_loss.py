"""The fused head loss equals `soft_cross_entropy` on full logits: value, argmax and gradients, across blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hstap.train.loss import head_cast, head_soft_cross_entropy, head_soft_cross_entropy_steps
from hstap.train.ttt import soft_cross_entropy


def _problem(b=3, s=11, h=16, vd=40, k=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=gen, requires_grad=True)
    weight = torch.randn(vd, h, generator=gen, requires_grad=True)
    ids = torch.randint(0, vd, (b, s, k), generator=gen)
    ids[0, :4, 2:] = -1  # outside the draft vocabulary: probability 0, as teacher_in_draft_vocab makes it
    probs = torch.softmax(torch.randn(b, s, k, generator=gen), -1).masked_fill(ids < 0, 0.0)
    mask = torch.rand(b, s, generator=gen) < 0.6
    return hidden, weight, ids, probs, mask


def _reference(hidden, weight, ids, probs, mask):
    logits = F.linear(hidden, weight)  # (B, S, Vd)
    loss, count = soft_cross_entropy(logits, ids, probs, mask)
    return loss, count, logits.argmax(-1)


def test_equals_soft_cross_entropy_on_full_logits_in_blocks():
    hidden, weight, ids, probs, mask = _problem()
    ref_loss, ref_count, ref_argmax = _reference(hidden, weight, ids, probs, mask)
    ref_grads = torch.autograd.grad(3.0 * ref_loss, (hidden, weight))  # a scale, as decay**k applies one
    for rows in (33, 7, 1):  # one block, ragged blocks (33 = 4·7 + 5), one row at a time
        loss, count, argmax = head_soft_cross_entropy(hidden, weight, ids, probs, mask, chunk_bytes=4 * 40 * rows)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        assert count == ref_count and torch.equal(argmax, ref_argmax)
        grads = torch.autograd.grad(3.0 * loss, (hidden, weight))
        for g, gr in zip(grads, ref_grads):
            torch.testing.assert_close(g, gr, atol=1e-6, rtol=1e-5)


def test_no_counted_positions_gives_zero_loss_and_gradient():
    hidden, weight, ids, probs, mask = _problem()
    loss, count, _ = head_soft_cross_entropy(hidden, weight, ids, probs, torch.zeros_like(mask))
    assert count == 0 and loss == 0
    assert all(g.abs().max() == 0 for g in torch.autograd.grad(loss, (hidden, weight)))


def test_no_grad_evaluation_returns_the_same_numbers():
    hidden, weight, ids, probs, mask = _problem(seed=1)
    with torch.no_grad():
        loss, count, argmax = head_soft_cross_entropy(hidden, weight, ids, probs, mask)
        ref_loss, ref_count, ref_argmax = _reference(hidden, weight, ids, probs, mask)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ref_loss)
    assert count == ref_count and torch.equal(argmax, ref_argmax)


def test_under_bf16_autocast_matches_the_autocast_reference():
    """Matmuls in bf16, softmax in fp32, gradients in the parameters' fp32: within bf16's rounding."""
    hidden, weight, ids, probs, mask = _problem(b=2, s=64, h=64, vd=256, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = head_soft_cross_entropy(hidden, weight, ids, probs, mask, chunk_bytes=4 * 256 * 50)
        ref_loss, _, _ = _reference(hidden, weight, ids, probs, mask)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    torch.testing.assert_close(loss, ref_loss, atol=1e-2, rtol=1e-2)
    for g, gr in zip(grads, ref_grads):
        assert g.dtype == gr.dtype == torch.float32
        torch.testing.assert_close(g, gr, atol=1e-3, rtol=3e-2)


def test_a_shared_head_cast_gives_the_same_numbers_and_gradient():
    """The TTT unroll casts the head once for its seven steps (`head_cast`): bit-equal to casting per call, and the
    weight's fp32 gradient still reaches it; outside autocast there is nothing to share."""
    hidden, weight, ids, probs, mask = _problem(b=2, s=32, h=64, vd=256, seed=3)
    assert head_cast(weight, hidden) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = head_cast(weight, hidden)
        shared = head_soft_cross_entropy(hidden, weight, ids, probs, mask, chunk_bytes=4 * 256 * 20, cast=cast)
        own = head_soft_cross_entropy(hidden, weight, ids, probs, mask, chunk_bytes=4 * 256 * 20)
    assert cast.dtype == torch.bfloat16 and not cast.requires_grad
    assert torch.equal(shared[0], own[0]) and torch.equal(shared[2], own[2])
    for a, b in zip(torch.autograd.grad(shared[0], (hidden, weight)), torch.autograd.grad(own[0], (hidden, weight))):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_all_steps_in_one_call_equal_the_weighted_sum_of_one_call_per_step():
    """The TTT unroll's heads in one call: total = Σ w_k · loss_k, the per-step losses, counts and argmaxes, and
    every gradient equal to one call per step (a step of weight 0 counts in the stats, not in the gradient), with
    one head-sized gradient kept for the backward instead of one per step."""
    steps = [_problem(b=2, s=9, h=16, vd=40, seed=10 + k) for k in range(3)]
    weight = steps[0][1]
    hiddens = [st[0] for st in steps]
    step_weights = [1.0, 0.8, 0.0]
    args = ([st[2] for st in steps], [st[3] for st in steps], [st[4] for st in steps])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        total, losses, counts, argmax = head_soft_cross_entropy_steps(hiddens, weight, *args, step_weights,
                                                                      chunk_bytes=4 * 40 * 7)
    assert sum(shape == weight.shape for shape in saved) == 1
    singles = [head_soft_cross_entropy(h, weight, ids, probs, mask, chunk_bytes=4 * 40 * 7)
               for h, ids, probs, mask in zip(hiddens, *args)]
    want_total = sum(w * one[0] for w, one in zip(step_weights, singles))
    torch.testing.assert_close(total, want_total, atol=1e-6, rtol=1e-6)
    for k, (loss, count, arg) in enumerate(singles):
        torch.testing.assert_close(losses[k], loss.detach(), atol=1e-6, rtol=1e-6)
        assert counts[k] == count and torch.equal(argmax[k], arg)
    got = torch.autograd.grad(2.0 * total, (weight, *hiddens), allow_unused=True)
    want = torch.autograd.grad(2.0 * want_total, (weight, *hiddens))
    assert got[-1] is None  # the step of weight 0 sends no gradient
    for g, gw in zip(got[:-1], want[:-1]):
        torch.testing.assert_close(g, gw, atol=1e-6, rtol=1e-5)
    assert want[-1].abs().max() == 0
    with pytest.raises(ValueError, match="one entry per step"):
        head_soft_cross_entropy_steps(hiddens, weight, *args, [1.0])


@pytest.mark.gpu
def test_weight_gradient_sum_on_cuda_in_fp32_matches_fp64():
    """On CUDA the head's weight gradient is summed by fp32-output matmuls over bf16 blocks: as close to the
    fp64 sum as fp32 accumulation of bf16 products allows (no bf16 rounding of each product)."""
    from hstap.train.loss import _add_weight_grad, _no_out_dtype

    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(300, 512, generator=gen).to(torch.bfloat16) for _ in range(3)]
    xs = [torch.randn(300, 256, generator=gen).to(torch.bfloat16) for _ in range(3)]
    acc = None
    for g, x in zip(gs, xs):
        acc = _add_weight_grad(acc, g.cuda(), x.cuda())
    assert not _no_out_dtype, _no_out_dtype
    want = sum(g.double().t() @ x.double() for g, x in zip(gs, xs))
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double().cpu(), want, atol=1e-3, rtol=1e-5)


def _block_reference(logits, ids, p, scale):
    """d loss / d logits by autograd on the definition, in fp64: Σ_rows scale · (−Σ_j p_j log softmax(x)[id_j])."""
    x = logits.detach().double().requires_grad_(True)
    loss = (-(p.double() * torch.log_softmax(x, -1).gather(-1, ids)).sum(-1) * scale.double()).sum()
    return loss, x.argmax(-1), torch.autograd.grad(loss, x)[0]


def test_block_numbers_equal_autograd_even_where_ids_repeat():
    """Outsiders of the draft vocabulary are clamped to id 0 with p = 0; where id 0 is also a real teacher id (or an
    id repeats) both forms must still give that id its one true gradient (in `block_numbers` a scatter of differing
    values at a repeated id would be a race)."""
    from hstap.train.loss import block_numbers, block_numbers_inplace

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen)
    ids = torch.randint(1, 50, (6, 4), generator=gen)
    ids[:, 0] = 0  # a real teacher id 0 ...
    ids[:3, 2:] = 0  # ... and clamped outsiders on the same id
    ids[3, 2] = ids[3, 1]  # a repeat inside (top-k ids never repeat; the tests' random ids may)
    p = torch.softmax(torch.randn(6, 4, generator=gen), -1)
    p[:3, 2:] = 0
    scale = torch.rand(6, generator=gen)
    ref_loss, ref_argmax, ref_grad = _block_reference(logits, ids, p, scale)
    for numbers in (block_numbers, block_numbers_inplace):
        loss, argmax, grad = numbers(logits, ids, p, scale, grads=True)  # each row's loss, unscaled
        torch.testing.assert_close((loss.double() * scale.double()).sum(), ref_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-7, rtol=1e-5)
        assert torch.equal(argmax, ref_argmax)
        assert numbers(logits, ids, p, scale, grads=False)[2] is None


@pytest.mark.gpu
def test_compiled_block_on_cuda_matches_fp64_within_bf16():
    """The compiled CUDA block against the fp64 definition on bf16 logits of a real block size: the loss and
    argmax exactly as fp32 computes them, the bf16 gradient within one bf16 step of each value."""
    from hstap.train.loss import COMPILED_BLOCK, _block_fn

    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(1000, 16384, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 16384, (1000, 32), generator=gen)
    ids[:10, 20:] = 0
    p = torch.softmax(torch.randn(1000, 32, generator=gen), -1)
    p[:10, 20:] = 0
    scale = torch.full((1000,), 1 / 1000)
    ref_loss, ref_argmax, ref_grad = _block_reference(logits.float(), ids, p, scale)
    args = [t.cuda() for t in (logits, ids, p, scale)]
    loss, argmax, grad = _block_fn(torch.device("cuda"))(*args, True)
    assert not COMPILED_BLOCK.failure, COMPILED_BLOCK.failure
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close((loss.double().cpu() * scale.double()).sum(), ref_loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(argmax.cpu(), ref_argmax)
    torch.testing.assert_close(grad.double().cpu(), ref_grad, atol=1e-9, rtol=2 ** -7)
