"""The drafter's elementwise chains — RMSNorm, rotary embedding, the MLP's gate — as fused kernels on CUDA.

Eager PyTorch runs each chain as several passes over a (tokens, hidden) tensor: a norm is an upcast, the
normalisation, a downcast and the weight's product, and the backward as many again. A TTT training step runs
four norms, two rotary embeddings and one gate per unrolled step, and on a GPU such passes, not the matmuls,
took most of the device time (docs/benchmarks.md, the fifth GPU run's profile). On CUDA each chain goes
through `torch.compile` (dynamic shapes: one kernel for every batch shape, forward and backward); on a CPU, or
once compiling has failed, the same Python function runs eagerly, so the CPU tests check the math the GPU runs.

    y = fused.rms_norm(x, weight, eps)      # weight · rms_norm(x in fp32), Llama's rounding, in x's dtype
    q = fused.rope(q, cos, sin)             # x·cos + rotate_half(x)·sin
    a = fused.silu_mul(gate, up)            # silu(gate) · up
    a = fused.swiglu(gate_up)               # the same of gate and up stacked (…, 2I): one gradient tensor

The first CUDA call compiles all four and runs them forward and backward on small inputs against their eager
forms (`check`): a compiler that fails or disagrees turns the fused path off for the process, with one line on
stderr, and training goes on eagerly. `enable(False)` (`hstap train --no-compile`) turns it off by hand.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F

from hstap.errors import first_line


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast: bool = False) -> torch.Tensor:
    """Llama's: weight · normed in the promoted dtype (an fp32 weight and bf16 x give fp32); `cast` (the caller is
    under autocast) rounds the product to x's dtype: training keeps fp32 master weights under bf16 autocast, and
    an fp32 output would be cast back by every matmul reading it (three casts a TTT step for q, k and v alone: on
    the 8B shape 42 copies of a (2,048, 8,192) tensor a step). Those matmuls get the same bf16
    numbers. A flag, not an autocast query in here: the compiled form stays free of global-state reads."""
    out = weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
    return out.to(x.dtype) if cast else out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, S, hd); cos/sin (B, S, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (…, 2I): gate then up, as the stacked matmul writes them (`Eagle3Drafter.stacked_weights`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER = {"rms_norm": _rms_norm, "rope": _rope, "silu_mul": _silu_mul, "swiglu": _swiglu}
_compiled: dict[str, Callable] = {}
_state = {"enabled": True, "checked": False, "failed": ""}
_config = {"devices": ("cuda",), "backend": "inductor"}  # tests run the compiled path on a CPU with aot_eager


def enable(on: bool) -> None:
    """Use the compiled chains on CUDA (the default) or never."""
    _state["enabled"] = on


def reset() -> None:
    """Forget the check, a failure and the compiled functions (tests)."""
    _state.update(checked=False, failed="")
    _compiled.clear()


def active() -> bool:
    """Whether CUDA calls take the compiled chains (after `check`, when it has run)."""
    return _state["enabled"] and not _state["failed"]


def failure() -> str:
    """Why the compiled chains were turned off in this process ('' when they were not)."""
    return _state["failed"]


def _turn_off(why: str) -> None:
    if not _state["failed"]:
        _state["failed"] = why
        print(f"hstap: fused drafter kernels off ({why}); continuing with the eager ones", file=sys.stderr)


def _sample_inputs(device: torch.device) -> dict[str, tuple]:
    """Small fp32 inputs, grads on every tensor. fp32, not the training step's bf16: a fused kernel keeps its
    intermediates in fp32 where eager rounds each to bf16 (in bf16 the two outputs differed by more than two bf16
    steps on a GPU), and the check is for miscompiles, not for that rounding."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).requires_grad_()

    return {"rms_norm": (rand(3, 5, 64), rand(64), 1e-5, False),
            "rope": (rand(2, 3, 5, 16), rand(2, 5, 16), rand(2, 5, 16)),
            "silu_mul": (rand(3, 5, 96), rand(3, 5, 96)), "swiglu": (rand(3, 5, 192),)}


def check(device: torch.device) -> bool:
    """Compile the chains and hold their forward and gradients to the eager ones on `device`, in fp32. False,
    with the fused path off, when any of that fails."""
    _state["checked"] = True
    try:
        with torch.inference_mode(False), torch.enable_grad():
            samples = _sample_inputs(device)
            for name, fn in _EAGER.items():
                _compiled[name] = torch.compile(fn, dynamic=True, backend=_config["backend"])
                args = samples[name]
                floats = [a for a in args if isinstance(a, torch.Tensor)]
                want = fn(*args)
                want_grads = torch.autograd.grad(want.float().square().sum(), floats)
                got = _compiled[name](*args)
                got_grads = torch.autograd.grad(got.float().square().sum(), floats)
                for a, b in zip((got, *got_grads), (want, *want_grads)):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    except Exception as e:  # noqa: BLE001 — a compiler failure must not end a training run: say so, go eager
        _turn_off(first_line(e)[:300])
        return False
    return True


def _dispatch(name: str, *args):
    x = args[0]
    if not (x.device.type in _config["devices"] and active()) or torch.compiler.is_compiling():
        return _EAGER[name](*args)
    if not _state["checked"] and not check(x.device):
        return _EAGER[name](*args)
    try:
        return _compiled[name](*args)
    except Exception as e:  # noqa: BLE001 — e.g. a shape the check did not compile: eager from now on
        _turn_off(f"{name}: {first_line(e)}"[:300])
        return _EAGER[name](*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: x normalised in fp32, rounded to x's dtype, times the weight (in the promoted dtype;
    under autocast in x's dtype, `_rms_norm`)."""
    return _dispatch("rms_norm", x, weight, eps, torch.is_autocast_enabled(x.device.type))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Llama's half-split convention: x (B, n, S, hd), cos/sin (B, S, hd)."""
    return _dispatch("rope", x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _dispatch("silu_mul", gate, up)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of the stacked (…, 2I) gate and up. Its gradient is one (…, 2I) tensor, written by the
    fused backward, which the stacked matmul's backward reads as it is: with `silu_mul` over the two halves,
    autograd concatenated their two gradients, one more pass over the MLP's widest activation per TTT step
    (on the 8B shape 1.6 GB a training step)."""
    return _dispatch("swiglu", gate_up)
