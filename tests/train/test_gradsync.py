"""FlatGradients in one process: the gradients live in the flat buffer the all-reduce sums, backward after backward,
and a gradient autograd or the optimizer replaced is put back with its values (2 ranks: tests/train/test_ddp.py)."""

import torch
from torch import nn

from hstap.train.distributed import Dist
from hstap.train.gradsync import FlatGradients


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3, bias=False))


def _backward(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).pow(2).sum().backward()


def _inside(flat: FlatGradients, p: nn.Parameter) -> bool:
    buffer = flat.buffers[0][0]
    start = buffer.data_ptr()
    return start <= p.grad.data_ptr() < start + buffer.numel() * buffer.element_size()


def test_gradients_accumulate_in_the_flat_buffer_and_equal_autograds():
    plain, viewed = _model(), _model()
    flat = FlatGradients(list(viewed.parameters()), Dist(0, 1, torch.device("cpu")))
    for seed in (1, 2):  # two backwards of one accumulated step
        _backward(plain, seed)
        _backward(viewed, seed)
    flat.average()
    for p, q in zip(plain.parameters(), viewed.parameters()):
        assert _inside(flat, q), "autograd replaced a gradient view instead of adding into it"
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert flat.buffers[0][0].abs().sum() > 0


def test_a_gradient_set_to_none_or_replaced_is_put_back_with_its_values():
    plain, viewed = _model(), _model()
    flat = FlatGradients(list(viewed.parameters()), Dist(0, 1, torch.device("cpu")))
    viewed.zero_grad(set_to_none=True)  # what an optimizer's default zero_grad does
    _backward(plain, 3)
    _backward(viewed, 3)  # autograd now makes fresh gradient tensors
    first = next(viewed.parameters())
    first.grad = first.grad * 1.0  # and one assigned by hand
    flat.average()
    for p, q in zip(plain.parameters(), viewed.parameters()):
        assert _inside(flat, q)
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
