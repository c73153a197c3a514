"""The TTT unroll's projections with their weight gradients summed inside the matmuls.

A training step runs the drafter's one decoder layer `steps` times (7 on a GPU), so each projection weight gets
`steps` weight gradients. Autograd rounds each product to bf16, then adds them pairwise in bf16, one more pass
over the weight per step: on the 8B shape 8.7 GB of elementwise traffic a training step (a fake-tensor op trace:
the largest single non-matmul cost). Here each step's weight-gradient matmul adds its product into
one running sum in its epilogue (`addmm_`, β = 1: the fp32 accumulator rounded once, where autograd rounded the
product and then the sum), and the sum goes to the parameters once, after the last step's backward.

    mm = accumulating_matmuls(drafter, torch.bfloat16)      # a `hstap.drafter.model.Matmuls`
    hidden = drafter.layer_step(ids, hidden, None, attend, rope=rope, mm=mm)   # every step of one unroll

Input gradients are what autograd computes (g @ W). `ENABLED` = False makes `hstap.train.ttt` use the drafter's
plain `matmuls` instead (bench/train_throughput.py --wgrad times both in one process).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd import Function

from hstap.drafter.model import Eagle3Drafter, Matmuls

ENABLED = True


class _Sum:
    """One weight's running gradient over an unroll's steps, in the matmul dtype; None until a step adds to it."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def add(self, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """value += grad_outᵀ · x over every leading position: grad_out (..., out), x (..., in)."""
        g, inp = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        if self.value is None:
            self.value = g.t() @ inp  # (out, in)
        else:
            self.value.addmm_(g.t(), inp)


class _Weight(Function):
    """Parameters → their casts to the matmul dtype, stacked along dim 0. Its backward runs after every use's
    (autograd orders it after all consumers) and hands each parameter its rows of the running sum."""

    @staticmethod
    def forward(ctx, total: _Sum, dtype: torch.dtype, *params: torch.Tensor) -> torch.Tensor:
        ctx.total, ctx.rows, ctx.dtypes = total, [p.shape[0] for p in params], [p.dtype for p in params]
        ctx.set_materialize_grads(False)  # the uses return no gradient for it: no zeros to allocate
        if len(params) == 1:
            return params[0].to(dtype)
        stacked = torch.empty(sum(ctx.rows), *params[0].shape[1:], dtype=dtype, device=params[0].device)
        for rows, p in zip(stacked.split(ctx.rows), params):
            rows.copy_(p)  # cast straight into its rows: no cast-then-concatenate pass
        return stacked

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        total = ctx.total.value
        if grad is not None:  # a use outside `_Linear` (none in the unroll): autograd's gradient, added in
            total = grad if total is None else total + grad
        if total is None:
            return (None, None, *[None] * len(ctx.rows))
        return (None, None, *[g.to(dt) for g, dt in zip(total.split(ctx.rows), ctx.dtypes)])


class _Linear(Function):
    """F.linear(x, weight) whose weight gradient goes into `total` instead of back through autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, total: _Sum) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.total = total
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.total.add(grad_out, x)
        return (grad_out @ weight if ctx.needs_input_grad[0] else None), None, None


def _projection(dtype: torch.dtype, *params: torch.Tensor):
    total = _Sum()
    weight = _Weight.apply(total, dtype, *params)
    if not torch.is_grad_enabled():  # evaluation: a plain matmul
        return functools.partial(F.linear, weight=weight)
    return lambda x: _Linear.apply(x.to(dtype), weight, total)


def accumulating_matmuls(drafter: Eagle3Drafter, dtype: torch.dtype) -> Matmuls:
    """The drafter's `Matmuls` for one unroll in `dtype` (autocast's matmul dtype under autocast), with each
    weight's gradients summed inside the weight-gradient matmuls (module docstring)."""
    attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
    return Matmuls(qkv=_projection(dtype, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                   gate_up=_projection(dtype, mlp.gate_proj.weight, mlp.up_proj.weight),
                   o=_projection(dtype, attn.o_proj.weight), down=_projection(dtype, mlp.down_proj.weight))
