"""Which elementwise kernels a piece of runtime code launches, by operand layout, counted without a GPU.

    counts = elementwise_census(lambda: rotary_qk(qkv, heads, kv_heads, cos, sin))
    # Counter({("mul", "broadcast"): 2, ("add", "dense"): 1, ...})

Why: on CUDA an elementwise op whose operands are of one shape and dense in one dim order runs the vectorised
kernel; a broadcast or strided one runs the generic `elementwise_kernel<128, 4>`, dearer at every launch — which
is what made a verification block of a few tokens cost more per op than a one-token step. The layout
is a property of the code, not of the device, so a CPU run under a dispatch mode counts exactly what CUDA would
launch: the runtime's tests hold the rotary and the MLP to dense ops at every block width with it, and
bench/verify_cost.py prints the census of a whole forward.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

# copies run as elementwise kernels too, though not tagged pointwise (cat and scatter have kernels of their own)
_ELEMENTWISE = {"copy_", "clone", "_to_copy"}


def _dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides over its non-unit dims when its elements fill one block of memory without gaps (in any dim
    order), else None: operands dense in the same order coalesce to one dimension, which CUDA's vectorised
    elementwise kernel needs."""
    dims = [(stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return None
        expected *= size
    return tuple(stride for stride, _ in dims)


def layout_of(tensors: list[torch.Tensor]) -> str:
    """"dense" (one shape, every operand dense in one dim order), "broadcast" (operands of different shapes) or
    "strided" (one shape, an operand with gaps or in another order)."""
    if len({t.shape for t in tensors}) > 1:
        return "broadcast"
    strides = {_dense_strides(t) for t in tensors}
    return "dense" if len(strides) == 1 and None not in strides else "strided"


def elementwise_census(body: Callable[[], object]) -> collections.Counter:
    """(op, layout) → how many times one call of `body` runs it, for every elementwise op (layout: `layout_of`
    over its tensor operands and outputs). Scalars and one-element tensors are left out of the comparison."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    counts: collections.Counter = collections.Counter()

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if torch.Tag.pointwise in func.tags or name in _ELEMENTWISE:
                tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                           if isinstance(t, torch.Tensor) and t.numel() > 1]
                if tensors:
                    counts[(name, layout_of(tensors))] += 1
            return out

    with Census():
        body()
    return counts
