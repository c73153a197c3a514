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
