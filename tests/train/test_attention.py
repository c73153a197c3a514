"""TTT attention without (S, S) scores equals the materialised implementation it replaced (kept below as the
reference), forward and gradients, on both backends; and a whole TTT unroll with the fused head loss equals the
old unroll (old attention, `drafter.step`, `soft_cross_entropy` on full logits)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab, target_to_draft_ids
from hstap.train.attention import TTTAttention, use_flex
from hstap.train.ttt import (TTTBatch, shift_left, soft_cross_entropy, teacher_in_draft_vocab, ttt_forward)

FP32 = dict(atol=1e-4, rtol=1e-4)  # fp32 sums in another order; a wrong mask or merge is off by O(1)


class ReferenceTTTAttention:
    """The implementation before issue 15 (hstap/train/ttt.py at 282e63f), verbatim: (B, nh, S, S) scores."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.rep = num_heads // num_kv_heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.future: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k.repeat_interleave(self.rep, dim=1))
        self.values.append(v.repeat_interleave(self.rep, dim=1))
        s = q.shape[2]
        if self.future is None or self.future.shape[0] != s:
            self.future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        q = q * q.shape[-1] ** -0.5
        prefix = (q @ self.keys[0].transpose(-1, -2)).masked_fill_(self.future, float("-inf"))
        diag = [(q * key).sum(-1, keepdim=True) for key in self.keys[1:]]
        weights = torch.softmax(torch.cat([prefix, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = weights[..., :s] @ self.values[0]
        for i, value in enumerate(self.values[1:]):
            out = out + weights[..., s + i: s + i + 1] * value
        return out


def _unroll(attend, qkv: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    return [attend(q, k, v) for q, k, v in qkv]


def _inputs(steps=4, b=2, nh=4, nkv=2, s=37, hd=8, device="cpu", dtype=torch.float32, grad=True):
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: (2 * torch.randn(*shape, generator=gen)).to(device, dtype).requires_grad_(grad)  # noqa: E731
    return [(make(b, nh, s, hd), make(b, nkv, s, hd), make(b, nkv, s, hd)) for _ in range(steps)]


def _check_against_reference(backend: str, device: str = "cpu", tol=FP32, dtype=torch.float32, hd: int = 8) -> None:
    qkv = _inputs(device=device, dtype=dtype, hd=hd)
    got = _unroll(TTTAttention(4, 2, backend), qkv)
    ref = _unroll(ReferenceTTTAttention(4, 2), qkv)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, **tol)
    leaves = [t for step in qkv for t in step]
    probe = [torch.randn(r.shape, generator=torch.Generator().manual_seed(i)).to(device, dtype)
             for i, r in enumerate(ref)]
    grads = torch.autograd.grad(sum((a * p).sum() for a, p in zip(got, probe)), leaves)
    grads_ref = torch.autograd.grad(sum((r * p).sum() for r, p in zip(ref, probe)), leaves)
    for g, gr in zip(grads, grads_ref):
        torch.testing.assert_close(g, gr, **tol)


def test_math_backend_equals_the_materialised_reference_forward_and_gradients():
    _check_against_reference("math")


def test_flex_backend_equals_the_reference_on_the_cpu(monkeypatch):
    """The flex path (padding to the block, the causal block mask, grouped heads, gradients through the
    log-sum-exp) run by PyTorch's uncompiled flex attention. Its CPU guard refuses backward although the
    uncompiled backward is plain PyTorch; lifted here only, to check our use of it."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile()"
        _check_against_reference("flex")


def test_flexdiag_backend_equals_the_reference_on_the_cpu(monkeypatch):
    """One flex call over the step-0 and the diagonal keys laid end to end (padded sections, the position-tensor
    mask, grouped heads), uncompiled on the CPU as the flex test above: the reference's output and gradients."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _check_against_reference("flexdiag")


def _check_bf16_against_fp64(backend: str, device: str = "cpu", hd: int = 16) -> None:
    """bf16: the reference itself rounds (softmax weights to bf16, the diagonal terms added in bf16), so two bf16
    implementations differ by more than bf16's step where the softmax is sharp (seen on an H200: 0.19 on outputs
    of ~4). Both are held to the fp64 result on the same bf16 inputs instead; `backend` may be off by at most
    twice the reference's own error (a wrong mask or merge is off by O(1))."""
    qkv = _inputs(device=device, dtype=torch.bfloat16, hd=hd)
    got = _unroll(TTTAttention(4, 2, backend), qkv)
    ref = _unroll(ReferenceTTTAttention(4, 2), qkv)
    qkv64 = [tuple(t.detach().double().requires_grad_() for t in step) for step in qkv]
    truth = _unroll(ReferenceTTTAttention(4, 2), qkv64)
    probe = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(device)
             for i, t in enumerate(truth)]
    leaves, leaves64 = [t for step in qkv for t in step], [t for step in qkv64 for t in step]
    grads = torch.autograd.grad(sum((a.double() * p).sum() for a, p in zip(got, probe)), leaves)
    grads_ref = torch.autograd.grad(sum((r.double() * p).sum() for r, p in zip(ref, probe)), leaves)
    grads64 = torch.autograd.grad(sum((t * p).sum() for t, p in zip(truth, probe)), leaves64)
    for a, r, t in [*zip(got, ref, truth), *zip(grads, grads_ref, grads64)]:
        err, ref_err = (a.double() - t).abs().max().item(), (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-2, f"{backend} off by {err:.3g}, the bf16 reference by {ref_err:.3g}"


def test_math_backend_in_bf16_is_as_close_to_fp64_as_the_reference():
    _check_bf16_against_fp64("math")


@pytest.mark.gpu
def test_flex_backend_on_cuda_equals_the_reference():
    """The compiled kernel: fp32 to fp32 tolerance; bf16 held to fp64 like the bf16 reference (heads of 16, the
    kernel's smallest)."""
    _check_against_reference("flex", "cuda", tol=dict(atol=1e-4, rtol=1e-4), hd=16)
    _check_bf16_against_fp64("flex", "cuda")


@pytest.mark.gpu
def test_flexdiag_backend_on_cuda_equals_the_reference():
    """The compiled one-kernel path, as the flex test: fp32 to fp32 tolerance, bf16 held to fp64."""
    _check_against_reference("flexdiag", "cuda", tol=dict(atol=1e-4, rtol=1e-4), hd=16)
    _check_bf16_against_fp64("flexdiag", "cuda")


def test_flash_backend_equals_the_reference_on_the_cpu():
    """PyTorch's CPU flash kernels, with the backward that feeds them the whole softmax's output and log-sum-exp
    (hstap.train.attention_flash): fp32 forward and gradients equal the materialised reference."""
    _check_against_reference("flash")


def test_flash_backend_in_bf16_is_as_close_to_fp64_as_the_reference():
    _check_bf16_against_fp64("flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_backend_on_cuda_equals_the_reference():
    """The CUDA flash kernels take bf16 only: held to fp64 like the bf16 reference, heads of 128 (the 8B shape's),
    the diagonal merge and its backward compiled."""
    _check_bf16_against_fp64("flash", "cuda", hd=128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_backend_on_cuda_equals_the_reference():
    """cuDNN's fused attention for the prefix, its backward fed the whole softmax's output and log-sum-exp (as
    the flash path): bf16 held to fp64 like the bf16 reference, heads of 128 (the 8B shape's)."""
    _check_bf16_against_fp64("cudnn", "cuda", hd=128)


def test_cudnn_backend_refuses_what_its_kernels_cannot_run_in_one_line():
    q, k, v = _inputs(steps=1, hd=8, grad=False)[0]  # fp32, on the CPU
    with pytest.raises(ValueError, match="backend 'cudnn'.*float32 and head_dim 8 on cpu.*--ttt-attention auto"):
        TTTAttention(4, 2, "cudnn")(q, k, v)


def test_flash_backend_refuses_what_its_kernels_cannot_run_in_one_line():
    q, k, v = _inputs(steps=1, hd=8, dtype=torch.float16, grad=False)[0]
    with pytest.raises(ValueError, match="backend 'flash'.*float16.*--ttt-attention auto"):
        TTTAttention(4, 2, "flash")(q, k, v)


@pytest.mark.parametrize("backend, cuda, head_dim, flex", [
    ("auto", True, 64, True), ("auto", True, 16, True), ("auto", True, 8, False), ("auto", False, 64, False),
    ("math", True, 64, False), ("flex", False, 64, True), ("flex", True, 16, True), ("flexdiag", True, 16, True)])
def test_use_flex_picks_the_kernel_the_device_and_head_size_allow(backend, cuda, head_dim, flex):
    """The first GPU run of the flex test (2026-12-01) failed inside the compiler on 8-wide heads: "auto" now
    falls back to math there."""
    assert use_flex(backend, cuda, head_dim) is flex


@pytest.mark.parametrize("backend", ["flex", "flexdiag"])
def test_explicit_flex_on_heads_the_kernel_refuses_is_one_line(backend):
    with pytest.raises(ValueError, match=f"backend '{backend}': head_dim 8 is below the kernel's minimum 16"):
        use_flex(backend, True, 8)


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(ValueError, match="auto, cudnn, flash, flex, flexdiag, math"):
        TTTAttention(4, 2, "sdpa")


def reference_ttt_forward(drafter: Eagle3Drafter, batch: TTTBatch, t2d_ids: torch.Tensor, steps: int,
                          decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unroll before issue 15: full (B, S, Vd) logits per step, then `soft_cross_entropy`. → (loss, stats)."""
    cfg = drafter.config
    attend = ReferenceTTTAttention(cfg.num_attention_heads, cfg.num_key_value_heads)
    b, s = batch.input_ids.shape
    positions = torch.arange(s).expand(b, s)
    hidden = drafter.project(batch.aux)
    total, stats = torch.zeros(()), []
    for k in range(steps):
        hidden, logits = drafter.step(shift_left(batch.input_ids, 1 + k, 0), hidden, positions + k, attend)
        draft_ids, probs, inside = teacher_in_draft_vocab(shift_left(batch.topk_ids, 1 + k, 0),
                                                          shift_left(batch.topk_logprobs, 1 + k, float("-inf")),
                                                          t2d_ids)
        weight = shift_left(batch.loss_mask & batch.valid, 2 + k, False) & inside & batch.valid
        loss, count = soft_cross_entropy(logits, draft_ids, probs, weight)
        total = total + decay ** k * loss
        hit = (logits.argmax(-1) == draft_ids[..., 0]) & weight
        stats.append(torch.stack([loss.detach().double(), hit.sum().double(), count.double()]))
    return total, torch.stack(stats, dim=1)


def _tiny_drafter() -> tuple[Eagle3Drafter, torch.Tensor]:
    """A 32-wide drafter over a 50-token vocabulary (20 draft tokens), and its target-to-draft id map."""
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4],
                        target_model_id="tiny", target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.arange(50, 0, -1) % 7, 20)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    return drafter, target_to_draft_ids(drafter.d2t, 50)


def test_ttt_unroll_equals_the_old_unroll_forward_and_gradients():
    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    b, s = 3, 21
    valid = torch.arange(s)[None] < torch.tensor([[21], [15], [9]])  # right padding
    batch = TTTBatch(aux=torch.randn(b, s, 96), input_ids=torch.randint(0, 50, (b, s)) * valid,
                     loss_mask=torch.rand(b, s) < 0.7, valid=valid, topk_ids=torch.randint(0, 50, (b, s, 6)),
                     topk_logprobs=torch.log_softmax(torch.randn(b, s, 6), -1).masked_fill(~valid[..., None],
                                                                                            float("-inf")))
    params = [p for p in drafter.parameters() if p.requires_grad]
    out = ttt_forward(drafter, batch, t2d_ids, steps=4, decay=0.8)
    grads = torch.autograd.grad(out.loss, params)
    ref_loss, ref_stats = reference_ttt_forward(drafter, batch, t2d_ids, 4, 0.8)
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(out.loss, ref_loss, **FP32)
    torch.testing.assert_close(out.stats, ref_stats, **FP32)
    assert out.stats[2].min() > 0  # every step counted some positions
    for (name, _), g, gr in zip([(n, p) for n, p in drafter.named_parameters() if p.requires_grad], grads, ref_grads):
        torch.testing.assert_close(g, gr, **FP32, msg=name)


def test_backward_keeps_no_sequence_by_sequence_or_sequence_by_vocab_tensor(monkeypatch):
    """What a training step holds for its backward: with flex attention and the fused head loss, nothing of shape
    (…, S, S) or (…, S, Vd) — the two terms that grew with sequence² and with vocabulary × sequence × TTT. The
    old unroll saves both (checked too, so the probe can see them)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)  # see test_flex_backend_equals_the_reference
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=24, aux_layer_ids=[1, 2, 4],
                        target_model_id="tiny", target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = build_draft_vocab(torch.arange(50) % 9, 24)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    t2d_ids = target_to_draft_ids(drafter.d2t, 50)
    b, s = 2, 40  # flex pads 40 to its 128-block
    batch = TTTBatch(aux=torch.randn(b, s, 96), input_ids=torch.randint(0, 50, (b, s)),
                     loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                     topk_ids=torch.randint(0, 50, (b, s, 6)), topk_logprobs=torch.randn(b, s, 6))

    def saved_shapes(run) -> list[tuple[int, ...]]:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            run()
        return shapes

    def grows(shape: tuple[int, ...]) -> bool:
        return sum(d in (s, 128) for d in shape) >= 2 or (s in shape and 24 in shape)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        new = saved_shapes(lambda: ttt_forward(drafter, batch, t2d_ids, steps=3, attention="flex"))
    old = saved_shapes(lambda: reference_ttt_forward(drafter, batch, t2d_ids, 3, 0.8))
    assert not [shape for shape in new if grows(shape)]
    assert (b, 4, s, s) in old and (b, s, 24) in old


def test_norms_in_the_autocast_dtype_give_the_same_step_as_fp32_norm_outputs(monkeypatch):
    """Under bf16 autocast with fp32 master weights the norms return bf16 (`fused._rms_norm`), where weight · bf16
    used to promote to fp32 for every matmul to cast back: the same loss bit for bit (each matmul sees the same
    bf16 numbers), and fp32 parameter gradients within bf16 rounding of the old ones (where a norm's output feeds
    several matmuls — q, k, v; gate, up — their input gradients now meet in bf16, as in any bf16 model, not fp32)."""
    from hstap.drafter import fused

    torch.manual_seed(1)
    drafter, t2d_ids = _tiny_drafter()
    b, s = 2, 17
    batch = TTTBatch(aux=torch.randn(b, s, 96).to(torch.bfloat16), input_ids=torch.randint(0, 50, (b, s)),
                     loss_mask=torch.ones(b, s, dtype=torch.bool), valid=torch.ones(b, s, dtype=torch.bool),
                     topk_ids=torch.randint(0, 50, (b, s, 6)), topk_logprobs=torch.log_softmax(torch.randn(b, s, 6), -1))
    params = [p for p in drafter.parameters() if p.requires_grad]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(drafter, batch, t2d_ids, steps=3, decay=0.8)
        return out.loss, torch.autograd.grad(out.loss, params)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(3, 32).to(torch.bfloat16)
        assert drafter.norm(x).dtype == torch.bfloat16 and drafter.norm.weight.dtype == torch.float32
    loss, grads = step()
    monkeypatch.setitem(fused._EAGER, "rms_norm",
                        lambda x, w, eps, cast: w * torch.nn.functional.rms_norm(x.float(), x.shape[-1:],
                                                                                 eps=eps).to(x.dtype))
    old_loss, old_grads = step()
    assert torch.equal(loss, old_loss)
    for g, old in zip(grads, old_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, old, rtol=2 ** -7, atol=1e-2 * float(old.abs().max()))


def _merge_inputs(k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, nh, nkv, s, hd = 2, 8, 2, 13, 16

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    return rand(b, nh, s, hd), rand(b, nh, s, hd), rand(b, nh, s), [rand(b, nkv, s, hd) for _ in range(k)], \
        [rand(b, nkv, s, hd) for _ in range(k)]


@pytest.mark.parametrize("k", [1, 3])
def test_pointwise_merge_equals_the_batched_matmul_merge(k):
    """The form CUDA compiles (products and sums over the stacked diagonal keys) computes `_merge_fp32`'s numbers,
    forward and every gradient, in fp32 to rounding."""
    from hstap.train.attention import _merge_fp32, merge_pointwise

    q, out, lse, keys, values = _merge_inputs(k)
    leaves = [q, out, lse, *keys, *values]
    got = merge_pointwise(q, out, lse, torch.stack(keys, 2), torch.stack(values, 2), 0.25)
    want = _merge_fp32(q, out, lse, keys, values, 0.25)
    torch.testing.assert_close(got, want, **FP32)
    for g, w in zip(torch.autograd.grad(got.square().sum(), leaves), torch.autograd.grad(want.square().sum(), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_failing_compiled_merge_falls_back_once_with_one_line(monkeypatch, capsys):
    import hstap.train.attention as attention
    from hstap.compiling import CompiledOr
    from hstap.train import merge_kernel

    def broken(fn, **kwargs):
        raise RuntimeError("inductor says no\nmore trace")

    merge = CompiledOr(attention.merge_pointwise, "TTT diagonal merge", "the batched-matmul one")
    monkeypatch.setattr(attention, "COMPILED_MERGE", merge)
    monkeypatch.setattr(attention, "_compiled_merge_here", lambda q: not merge.failure)
    monkeypatch.setattr(merge_kernel.KERNELS, "enabled", False)  # not the Triton kernels (test_merge_kernel.py)
    monkeypatch.setattr(torch, "compile", broken)
    q, out, lse, keys, values = _merge_inputs(2, seed=1)
    want = attention._merge_fp32(q, out, lse, keys, values, 0.25)
    assert torch.equal(attention.merge_diagonal(q, out, lse, keys, values, 0.25), want)
    assert torch.equal(attention.merge_diagonal(q, out, lse, keys, values, 0.25), want)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hstap: the compiled TTT diagonal merge failed (RuntimeError: inductor says no); continuing "
                   "with the batched-matmul one"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_merge_on_cuda_equals_the_batched_matmul_merge(monkeypatch):
    from hstap.train import attention, merge_kernel

    monkeypatch.setattr(merge_kernel.KERNELS, "enabled", False)
    q, out, lse, keys, values = (t.cuda() if isinstance(t, torch.Tensor) else [x.cuda() for x in t]
                                 for t in _merge_inputs(3, seed=2))
    assert attention._compiled_merge_here(q)
    got = attention.merge_diagonal(q, out, lse, keys, values, 0.25)
    assert not attention.COMPILED_MERGE.failure, attention.COMPILED_MERGE.failure
    torch.testing.assert_close(got, attention._merge_fp32(q, out, lse, keys, values, 0.25), rtol=1e-5, atol=1e-5)


def test_flex_compile_mode_reaches_torch_compile(monkeypatch):
    """`FLEX_COMPILE_MODE` (bench/train_throughput.py --flex-mode) is the mode the CUDA flex kernel compiles in."""
    from hstap.train import attention

    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: modes.append(mode) or fn)
    attention._flex.cache_clear()
    try:
        attention._flex(True, "max-autotune-no-cudagraphs")
        attention._flex(True, None)
    finally:
        attention._flex.cache_clear()
    assert modes == ["max-autotune-no-cudagraphs", None]


@pytest.mark.parametrize("backend", ["flex", "flexdiag", "cudnn"])
def test_cuda_backends_are_refused_for_training_off_cuda_in_one_line(tmp_path, backend):
    """flex and cuDNN attention have no CPU backward: said before anything loads, not as their own error mid-run."""
    from hstap.errors import HstapError
    from hstap.train.config import TrainConfig
    from hstap.train.rundir import preflight

    cfg = TrainConfig(online=True, data="sharegpt", out=tmp_path / "run", ttt_attention=backend, device="cpu")
    with pytest.raises(HstapError, match=f"--ttt-attention {backend} trains on CUDA only") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)


def test_flexdiag_masks_of_every_length_and_step_count_share_compiled_graphs():
    """A training run meets many lengths and every step count: dynamo compiles flex attention for the first shape,
    once more when the key length changes and once more for the query length (dynamic from then on), and never
    again for the flexdiag masks of new lengths or step counts."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention import flex_attention as fa

    from hstap.train import attention

    torch._dynamo.reset()
    counters.clear()
    flex = torch.compile(fa.flex_attention, backend="eager")  # dynamo's guards alone, no code generation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for s in (128, 256, 384, 512):
            for sections in range(1, 6):
                q = torch.randn(1, 4, s, 16)
                k, v = torch.randn(1, 2, s * sections, 16), torch.randn(1, 2, s * sections, 16)
                flex(q, k, v, block_mask=attention._ttt_block_mask(s, sections, q.device), scale=0.25,
                     enable_gqa=True)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    torch._dynamo.reset()
