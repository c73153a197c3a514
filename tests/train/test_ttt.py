import pytest
import torch
import torch.nn.functional as F

from hstap.train.ttt import estimated_tau, shift_left, soft_cross_entropy, teacher_in_draft_vocab


def test_soft_ce_equals_dense_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 12)
    probs_dense = torch.softmax(torch.randn(2, 5, 12), -1)
    top = probs_dense.topk(12, -1)  # the full distribution as "top-k"
    weight = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    loss, n = soft_cross_entropy(logits, top.indices, top.values, weight)
    ref = F.cross_entropy(logits[weight], probs_dense[weight])
    assert n == 7
    torch.testing.assert_close(loss, ref)


def test_teacher_restricted_to_draft_vocab_and_renormalised():
    t2d = torch.tensor([0, -1, 1, -1, 2])  # target ids 1 and 3 are outside
    ids = torch.tensor([[[1, 2, 4]], [[2, 3, 0]]])  # (B=2, S=1, K=3)
    lp = torch.log(torch.tensor([[[0.5, 0.3, 0.2]], [[0.6, 0.3, 0.1]]]))
    draft, probs, argmax_in = teacher_in_draft_vocab(ids, lp, t2d)
    assert draft.tolist() == [[[-1, 1, 2]], [[1, -1, 0]]]
    torch.testing.assert_close(probs, torch.tensor([[[0.0, 0.6, 0.4]], [[6 / 7, 0.0, 1 / 7]]]))
    assert argmax_in.tolist() == [[False], [True]]


def test_shift_left_and_tau_estimate():
    x = torch.arange(6).view(1, 6)
    assert shift_left(x, 2, -1).tolist() == [[2, 3, 4, 5, -1, -1]]
    runs = torch.tensor([0, 1, 3, 7])
    ok = torch.tensor([7, 7, 7, 2])
    tau1, n1 = estimated_tau(runs, ok, 1)
    assert n1 == 4 and tau1 == pytest.approx(1 + (0 + 1 + 1 + 1) / 4)
    tau3, n3 = estimated_tau(runs, ok, 3)
    assert n3 == 3 and tau3 == pytest.approx(1 + (0 + 1 + 3) / 3)  # the last position lacks 3 countable steps


def test_loss_on_all_counts_prompt_positions_too(small_store, target):
    """`--loss-on all` counts every position that predicts a token of the sample (prompts included); the default
    counts those predicting an answer token. Counted positions are recomputed here from the stored tokens, masks and
    teacher; on a batch whose every token is an answer token the two modes are the same loss."""
    import dataclasses

    from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
    from hstap.store import open_store
    from hstap.train.data import StoreSource, load_batch
    from hstap.train.ttt import ttt_forward

    store = open_store(small_store)
    layers = list(store.manifest.meta.layer_ids)
    batch = load_batch(StoreSource(store), [0, 1, 2, 3], layers, torch.device("cpu"))
    vocab = target.model.config.vocab_size
    d2t, t2d = build_draft_vocab(torch.bincount(batch.input_ids[batch.valid], minlength=vocab), 2048)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target.model.config, layers, 2048, "m", "f"))
    drafter.init_from_target(target.model, d2t, t2d)
    t2d_ids = target_to_draft_ids(d2t, vocab)
    steps = 3
    with torch.no_grad():
        runs = {on: ttt_forward(drafter, batch, t2d_ids, steps, 0.8, "math", on) for on in ("answers", "all")}
    argmax_in = t2d_ids[batch.topk_ids[..., 0]] >= 0  # (B, S): the teacher's top-1 at t is in the draft vocab
    for on, counted in (("answers", batch.loss_mask & batch.valid), ("all", batch.valid)):
        expected = [int((shift_left(argmax_in, 1 + k, False) & shift_left(counted, 2 + k, False)).sum())
                    for k in range(steps)]
        assert runs[on].step_counted == expected, on
    prompt_share = 1 - int((batch.loss_mask & batch.valid).sum()) / int(batch.valid.sum())
    assert prompt_share > 0.1 and all(a > b for a, b in zip(runs["all"].step_counted, runs["answers"].step_counted))
    assert not torch.equal(runs["all"].loss, runs["answers"].loss)

    every = dataclasses.replace(batch, loss_mask=batch.valid.clone())
    with torch.no_grad():
        same = [ttt_forward(drafter, every, t2d_ids, steps, 0.8, "math", on).loss for on in ("answers", "all")]
    assert torch.equal(same[0], same[1])
    with pytest.raises(ValueError, match="loss_on='prompts'"):
        ttt_forward(drafter, batch, t2d_ids, steps, 0.8, "math", "prompts")


def test_shift_windows_are_the_shifted_tensors_for_every_step():
    """The unroll reads each step's shifted inputs as windows of one padded copy (`shift_windows`): for ids,
    probabilities and masks, up to the largest shift it is made for, x[:, n:] followed by n columns of `fill`."""
    from hstap.train.ttt import shift_windows

    gen = torch.Generator().manual_seed(0)
    for x, fill in [(torch.randint(0, 9, (3, 11), generator=gen), -1), (torch.rand(2, 11, 4, generator=gen), 0.0),
                    (torch.rand(2, 11, generator=gen) < 0.5, False)]:
        window = shift_windows(x, fill, 9)
        for n in range(10):
            want = torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], dim=1)
            assert torch.equal(window(n), want), (x.dtype, n)
            assert torch.equal(shift_left(x, n, fill), want), (x.dtype, n)


def test_layer_step_takes_a_precomputed_rotary_window():
    """`layer_step(..., rope=)` with a slice of one table over all positions equals the step computing its own
    rotary tables from the positions (the TTT unroll passes the slice)."""
    from hstap.drafter import DrafterConfig, Eagle3Drafter
    from hstap.train.attention import TTTAttention

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4], target_model_id="t",
                        target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    drafter = Eagle3Drafter(cfg)
    ids, hidden = torch.randint(0, 50, (2, 9)), torch.randn(2, 9, 32)
    k = 3
    cos, sin = drafter.rotary(torch.arange(9 + 5)[None], hidden.dtype)
    got = drafter.layer_step(ids, hidden, None, TTTAttention(4, 2), rope=(cos[:, k: k + 9], sin[:, k: k + 9]))
    want = drafter.layer_step(ids, hidden, torch.arange(9).expand(2, 9) + k, TTTAttention(4, 2))
    assert torch.equal(got, want)


def test_stacked_projections_equal_the_five_separate_ones_with_gradients():
    """The unroll runs q/k/v and gate/up as two matmuls over `stacked_weights` (made once per unroll), and
    `accumulating_matmuls` sums each weight's gradients over the steps inside its matmuls: the same step and the
    same parameter gradients as the five projections, in fp32 to rounding."""
    from hstap.drafter import DrafterConfig, Eagle3Drafter
    from hstap.train.attention import TTTAttention
    from hstap.train.shared import accumulating_matmuls

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4], target_model_id="t",
                        target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    drafter = Eagle3Drafter(cfg)
    ids, hidden, positions = torch.randint(0, 50, (2, 9)), torch.randn(2, 9, 32), torch.arange(9).expand(2, 9)
    params = [p for p in drafter.parameters() if p.requires_grad]
    outs = []
    for mm in (None, drafter.matmuls(torch.float32), accumulating_matmuls(drafter, torch.float32)):
        attend = TTTAttention(4, 2)
        h = drafter.layer_step(ids, hidden, positions, attend, mm=mm)
        h = drafter.layer_step(ids, h, positions + 1, attend, mm=mm)  # two steps share the weights
        outs.append((h, torch.autograd.grad(h.square().sum(), params, allow_unused=True)))
    (want, want_grads), *others = outs
    for got, got_grads in others:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(got_grads, want_grads):
            if w is None:
                assert g is None
            else:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
