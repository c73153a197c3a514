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


def _two_rank_average(rank: int, rendezvous: str, out: str) -> None:
    """Each rank backward on its own batch, then averaged in fp32 and in bf16; saved for the parent to compare."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    dist = Dist(rank, 2, torch.device("cpu"))
    own = []
    for seed in (0, 1):  # both ranks' batches here: their mean is what every form must give
        reference = _model()
        _backward(reference, seed)
        own.append([p.grad for p in reference.parameters()])
    results = {"mean": [(a + b) / 2 for a, b in zip(*own)],
               "scale": [torch.maximum(a.abs(), b.abs()) for a, b in zip(*own)]}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = _model()
        flat = FlatGradients(list(model.parameters()), dist, dtype)
        _backward(model, rank)
        flat.average()
        results[name] = [p.grad.clone() for p in model.parameters()]
    torch.save(results, f"{out}/rank{rank}.pt")
    tdist.destroy_process_group()


def test_two_ranks_average_in_fp32_exactly_and_in_bf16_within_its_rounding(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_average, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    mean = ranks[0]["mean"]
    for form in ("fp32", "bf16"):
        for a, b in zip(ranks[0][form], ranks[1][form]):
            assert torch.equal(a, b), f"{form}: the ranks hold different gradients"
    for got, want in zip(ranks[0]["fp32"], mean):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # each rank's gradient rounded to bf16, then their sum: bf16's step (2^-8) of the larger term, per element
    for got, want, scale in zip(ranks[0]["bf16"], mean, ranks[0]["scale"]):
        assert ((got - want).abs() <= 2 ** -7 * scale + 1e-12).all()
    assert any(not torch.equal(g, m) for g, m in zip(ranks[0]["bf16"], mean))  # it did cross in bf16
    assert all(torch.equal(g, g.bfloat16().float()) for g in ranks[0]["bf16"])


def test_bf16_gradients_with_ddps_hook_are_refused_off_nccl_in_one_line(tmp_path):
    """PyTorch's bf16 DDP hook runs on NCCL only; the flat all-reduce takes bf16 anywhere."""
    import pytest

    from hstap.errors import HstapError
    from hstap.train.config import TrainConfig
    from hstap.train.rundir import preflight

    cfg = TrainConfig(online=True, data="sharegpt", out=tmp_path / "run", grad_reduce_dtype="bf16")
    with pytest.raises(HstapError, match="needs NCCL .*: add --grad-reduce after") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)
    preflight(cfg.model_copy(update={"grad_reduce": "after"}))
