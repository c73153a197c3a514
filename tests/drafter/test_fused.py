"""The fused drafter chains compute what their eager forms compute, and a compiler failure costs a line on stderr,
never a training run. On the CPU the compiled path runs through dynamo and AOTAutograd with the aot_eager
backend (no code generation); the gpu-marked test compiles with inductor."""

from __future__ import annotations

import pytest
import torch

from hstap.drafter import fused
from hstap.drafter.model import MLP, Matmuls, RMSNorm, apply_rope

FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setitem(fused._config, "devices", ("cpu", "cuda"))
    monkeypatch.setitem(fused._config, "backend", "aot_eager")
    fused.reset()
    yield
    fused.reset()


def _reference_norm(x, weight, eps):
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double() * weight.double()


def test_the_compiled_chains_equal_their_definitions_with_gradients(compiled_on_cpu):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=gen, requires_grad=True)
    weight = (torch.rand(32, generator=gen) + 0.5).requires_grad_()
    q = torch.randn(2, 3, 7, 16, generator=gen, requires_grad=True)
    cos, sin = torch.randn(2, 7, 16, generator=gen), torch.randn(2, 7, 16, generator=gen)
    gate, up = torch.randn(2, 7, 48, generator=gen, requires_grad=True), torch.randn(2, 7, 48, generator=gen)
    gate_up = torch.randn(2, 7, 96, generator=gen, requires_grad=True)
    got = [fused.rms_norm(x, weight, 1e-5), fused.rope(q, cos, sin), fused.silu_mul(gate, up), fused.swiglu(gate_up)]
    assert fused._compiled and fused.active(), fused.failure()  # the compiled path ran, not the fallback
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    want = [_reference_norm(x, weight, 1e-5).float(), q * cos[:, None] + rotated * sin[:, None],
            torch.nn.functional.silu(gate) * up, torch.nn.functional.silu(gate_up[..., :48]) * gate_up[..., 48:]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32)
    inputs = (x, weight, q, gate, gate_up)
    grads = torch.autograd.grad(sum(g.square().sum() for g in got), inputs)
    want_grads = torch.autograd.grad(sum(w.square().sum() for w in want), inputs)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_drafter_modules_run_through_the_chains(compiled_on_cpu, monkeypatch):
    calls = []
    for name in ("rms_norm", "rope", "silu_mul", "swiglu"):
        eager = fused._EAGER[name]
        monkeypatch.setitem(fused._EAGER, name, lambda *a, _e=eager, _n=name: calls.append(_n) or _e(*a))
    fused.enable(False)  # eager dispatch: every call lands in _EAGER, where the probe counts it
    try:
        RMSNorm(8, 1e-5)(torch.randn(2, 8))
        apply_rope(torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4))
        mlp = MLP(8, 12)
        mlp(torch.randn(2, 8))
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # the TTT unroll's form (`Matmuls`)
        mm = Matmuls(qkv=None, gate_up=lambda x: x @ gate_up.t(), o=None, down=mlp.down_proj)
        mlp(torch.randn(2, 8), mm)
    finally:
        fused.enable(True)
    assert calls == ["rms_norm", "rope", "silu_mul", "swiglu"]


def test_a_compiler_failure_turns_the_fused_path_off_and_keeps_the_result(compiled_on_cpu, monkeypatch, capsys):
    def broken(fn, **kwargs):
        raise RuntimeError("no compiler here\nsecond line of a long trace")

    monkeypatch.setattr(torch, "compile", broken)
    x, weight = torch.randn(3, 16), torch.rand(16) + 0.5
    got = fused.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, _reference_norm(x, weight, 1e-6).float(), **FP32)
    assert not fused.active() and fused.failure() == "RuntimeError: no compiler here"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hstap: fused drafter kernels off (RuntimeError: no compiler here); continuing with the eager ones"]
    fused.rms_norm(x, weight, 1e-6)  # later calls: eager, silently
    assert capsys.readouterr().err == ""


def test_a_compiled_chain_that_disagrees_is_not_used(compiled_on_cpu, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda *a: fn(*a) + 1.0))  # a miscompile
    fused.silu_mul(torch.randn(4, 8), torch.randn(4, 8))
    assert not fused.active() and "AssertionError" in fused.failure()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiles_the_chains_on_cuda():
    fused.reset()
    x = torch.randn(4, 33, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.rand(576, device="cuda", requires_grad=True)
    out = fused.rms_norm(x, weight, 1e-5)
    assert fused.active(), fused.failure()
    want = _reference_norm(x.detach(), weight.detach(), 1e-5)
    torch.testing.assert_close(out.double(), want, rtol=1.6e-2, atol=1e-2)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
