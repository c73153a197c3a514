"""A TTT training step's operators and the bytes each moves, at any shape, on a CPU in seconds (no GPU, no data).

    python bench/step_ops.py --shape 8b --draft-vocab 32000 --seq 2048             # the 8B step, by operator
    python bench/step_ops.py --shape 8b --seq 2048 --wgrad autograd --top 20       # ... with autograd's gradient sums

Fake tensors (shapes only) run the real training step — `TTTModel` under bf16 autocast, its backward, gradient
clipping — along the CUDA route: each compiled or hand-written kernel (the fused chains, flex attention, the
diagonal merge, the head's block) counts as one operator that reads its inputs and writes its outputs once, the
head's weight gradient as one fp32-output matmul, fused AdamW as one pass over its 28 bytes per parameter. Every
other aten operator counts the bytes of its tensor inputs and outputs (views move nothing), every matmul its FLOPs.

It prints the matmul FLOPs (and their time at --matmul-tflops), the non-matmul bytes (and their time at
--bandwidth), and the operators that move the most. A floor for the step's non-matmul device time, not a
measurement: a GPU profile says how far each kernel falls short of its bytes (docs/benchmarks.md, the eighteenth
session's analysis: it found the 8B step's largest avoidable traffic, autograd's per-step weight-gradient adds).
"""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import harness
from hstap.drafter import DrafterConfig, Eagle3Drafter, fused
from hstap.train import attention, loss, merge_kernel, shared
from hstap.train.ttt import TTTBatch, TTTModel, batch_tensors

SHAPES = {  # as bench/train_throughput.py
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, target_num_layers=30),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=128256, target_num_layers=32),
}
VIEWS = {"t", "view", "_unsafe_view", "detach", "slice", "select", "split", "split_with_sizes", "transpose", "expand",
         "as_strided", "permute", "reshape", "unsqueeze", "squeeze", "alias", "unbind", "narrow", "lift_fresh",
         "_reshape_alias", "chunk"}
MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul"}


@dataclass(frozen=True)
class Op:
    """One operator of the step: the phase (forward, backward, optimizer), its name, its tensors' shapes and dtypes,
    the bytes it reads and writes and its matmul FLOPs."""

    phase: str
    name: str
    inputs: tuple
    outputs: tuple
    bytes: int
    flops: int


def _meta(tensors) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Recorder(TorchDispatchMode):
    """Logs every aten operator run under it (outside `quiet`) as an `Op`."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "forward"
        self.quiet = 0

    def add(self, name: str, inputs, outputs, flops: int = 0) -> None:
        inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        outputs = [t for t in outputs if isinstance(t, torch.Tensor)]
        self.ops.append(Op(self.phase, name, _meta(inputs), _meta(outputs), _nbytes(inputs) + _nbytes(outputs), flops))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.quiet or name in VIEWS or func.is_view or name.startswith("sym_") or name in ("dim", "numel"):
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        if name.endswith("_") and args:  # in place: writes its first argument (a list of them for _foreach_)
            outputs = [a for a in tree_flatten(args[0])[0] if isinstance(a, torch.Tensor)]
        if not outputs or name.startswith("empty"):  # queries (a tensor's device), allocations: nothing moves
            return out
        if name in MATMULS:
            a, b = inputs[-2], inputs[-1]  # addmm: (bias, mat1, mat2)
            flops = 2 * math.prod(a.shape) * b.shape[-1]
            self.add(name, [a, b], outputs, flops)
        elif name in ("embedding", "index"):
            self.add(name, [inputs[-1]], outputs + outputs)  # reads the rows it writes, not the whole table
        else:
            self.add(name, inputs, outputs)
        return out


@contextlib.contextmanager
def _quiet(rec: _Recorder):
    rec.quiet += 1
    try:
        yield
    finally:
        rec.quiet -= 1


def _kernel(rec: _Recorder, name: str, fn, *tensors):
    """fn(*tensors) as one fused kernel: its own operators unlogged, one `Op` with its inputs and outputs, forward
    and backward (the backward recomputes fn under autograd, unlogged, as a compiled backward's one kernel)."""

    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            with _quiet(rec):
                out = fn(*xs)
            rec.add(name, xs, out if isinstance(out, tuple) else (out,))
            return out

        @staticmethod
        def backward(ctx, *grads):
            xs = ctx.saved_tensors
            with _quiet(rec), torch.enable_grad():
                leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
                out = fn(*leaves)
                outs = out if isinstance(out, tuple) else (out,)
                pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
                wanted = [x for x in leaves if x.requires_grad]
                got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                               allow_unused=True))
            result = [next(got) if x.requires_grad else None for x in leaves]
            rec.add(f"{name}.backward", list(xs) + [g for g in grads if g is not None],
                    [g for g in result if g is not None])
            return tuple(result)

    return Kernel.apply(*tensors)


def _cuda_route(rec: _Recorder):
    """The patches that make a CPU step take the CUDA step's kernels, each counted as one (`_kernel`)."""
    causal, eager = attention.causal_prefix_math, dict(fused._EAGER)
    head_block = loss.block_numbers_inplace

    def chain(name, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]

        def fn(*ts):
            it = iter(ts)
            return eager[name](*[next(it) if isinstance(a, torch.Tensor) else a for a in args])
        return _kernel(rec, name, fn, *tensors)

    def flex_prefix(q, k, v, scale):
        return _kernel(rec, "flex attention", lambda q, k, v: causal(q, k, v, scale), q, k, v)

    def flex_diag(q, keys, values, scale):
        n = len(keys)

        def fn(q, *kv):
            out, lse = causal(q, kv[0], kv[n], scale)
            return out if n == 1 else attention._merge_fp32(q, out, lse, list(kv[1:n]), list(kv[n + 1:]), scale)
        return _kernel(rec, "flex attention (flexdiag)", fn, q, *keys, *values)

    def merge(q, out, lse, k_diag, v_diag, scale):
        return _kernel(rec, "diagonal merge", lambda *t: merge_kernel.merge_forward_reference(*t, scale)[0],
                       q, out, lse, k_diag, v_diag)

    def block(*args):
        with _quiet(rec):
            result = head_block(*args)
        rec.add("head loss block", args, [t for t in result if isinstance(t, torch.Tensor)])
        return result

    def weight_grad(acc, g, x):
        with _quiet(rec):
            product = (g.t() @ x).float()
            result = product if acc is None else acc.add_(product)
        rec.add("head weight gradient (fp32-output matmul)", [g, x] + ([acc] if acc is not None else []), [result],
                2 * math.prod(g.shape) * x.shape[-1])
        return result

    return [mock.patch.object(fused, "_dispatch", chain),
            mock.patch.object(attention, "causal_prefix_flex", flex_prefix),
            mock.patch.object(attention, "attend_flex_diag", flex_diag),
            mock.patch.object(attention, "_compiled_merge_here", lambda q: True),
            mock.patch.object(merge_kernel, "merge", merge),
            mock.patch.object(loss, "_block_fn", lambda device: block),
            mock.patch.object(loss, "_add_weight_grad", weight_grad)]


def trace_step(shape: str = "8b", draft_vocab: int = 32000, seq: int = 2048, batch: int = 1, ttt_steps: int = 7,
               attend: str = "flex", wgrad: str = "gemm", clip: bool = True) -> list[Op]:
    """The operators of one training step (see the module docstring). `attend`: flex or flexdiag (the backend of
    `TTTModel`); `wgrad`: gemm (hstap.train.shared) or autograd."""
    rec = _Recorder()
    dims = SHAPES[shape]
    with contextlib.ExitStack() as stack:
        for patch in _cuda_route(rec):
            stack.enter_context(patch)
        stack.enter_context(mock.patch.object(shared, "ENABLED", wgrad == "gemm"))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        cfg = DrafterConfig(**dims, draft_vocab_size=draft_vocab, aux_layer_ids=[1, 2, 3], target_model_id="ops",
                            target_fingerprint="ops", target_hidden_size=dims["hidden_size"])
        drafter = Eagle3Drafter(cfg)
        model = TTTModel(drafter, torch.zeros(cfg.vocab_size, dtype=torch.long), ttt_steps, 0.8, attend)
        h, b, s = cfg.hidden_size, batch, seq
        data = TTTBatch(torch.randn(b, s, 3 * h, dtype=torch.bfloat16), torch.zeros(b, s, dtype=torch.long),
                        torch.ones(b, s, dtype=torch.bool), torch.ones(b, s, dtype=torch.bool),
                        torch.zeros(b, s, 32, dtype=torch.long), torch.zeros(b, s, 32))
        params = [p for p in drafter.parameters() if p.requires_grad]
        with rec:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                total = model(*batch_tensors(data))[0]
            rec.phase = "backward"
            total.backward()
            rec.phase = "optimizer"
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            n = sum(p.numel() for p in params)
            rec.ops.append(Op("optimizer", "fused AdamW", (), (), 28 * n, 0))  # reads p, g, m, v; writes p, m, v
    return rec.ops


def summary(ops: list[Op], matmul_tflops: float, bandwidth_tbs: float, top: int) -> str:
    """The census as text: matmul FLOPs and their time, the other operators' bytes and theirs, the `top` operators
    by bytes moved (calls, GB, ms at `bandwidth_tbs`)."""
    ms = lambda nbytes: 1e3 * nbytes / (bandwidth_tbs * 1e12)  # noqa: E731
    flops = sum(op.flops for op in ops)
    moved = [op for op in ops if not op.flops]
    total = sum(op.bytes for op in moved)
    lines = [f"matmuls: {flops / 1e12:.2f} TFLOP, {1e3 * flops / (matmul_tflops * 1e12):.1f} ms at "
             f"{matmul_tflops:g} TFLOP/s",
             f"everything else: {total / 1e9:.2f} GB in {len(moved)} operators, {ms(total):.1f} ms at "
             f"{bandwidth_tbs:g} TB/s"]
    by_name = collections.defaultdict(lambda: [0, 0])
    for op in moved:
        by_name[(op.phase, op.name)][0] += 1
        by_name[(op.phase, op.name)][1] += op.bytes
    lines.append(f"{'phase':10s} {'operator':44s} {'calls':>5s} {'GB':>7s} {'ms':>6s}")
    for (phase, name), (calls, nbytes) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{phase:10s} {name:44s} {calls:5d} {nbytes / 1e9:7.2f} {ms(nbytes):6.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--attention", default="flex", choices=["flex", "flexdiag"])
    ap.add_argument("--wgrad", default="gemm", choices=["gemm", "autograd"],
                    help="the steps' weight gradients summed in the matmuls (hstap.train.shared) or by autograd")
    ap.add_argument("--no-clip", action="store_true", help="leave out gradient clipping (bench/train_throughput.py "
                                                           "does not clip; hstap train does)")
    ap.add_argument("--matmul-tflops", type=float, default=720.0,
                    help="the matmuls' rate (default: the H200's 8B TTT matmuls, ~91 %% of its measured 787)")
    ap.add_argument("--bandwidth", type=float, default=3.3, help="TB/s for the rest (H200: 4.8 peak, ~3.3 reached)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    run = harness.start(args)
    ops = trace_step(args.shape, args.draft_vocab, args.seq, args.batch, args.ttt_steps, args.attention, args.wgrad,
                     not args.no_clip)
    print(f"{args.shape}, draft vocab {args.draft_vocab}, {args.batch} x {args.seq} positions, TTT {args.ttt_steps}, "
          f"attention {args.attention}, weight gradients by {args.wgrad}" + ("" if args.no_clip else ", clipped"))
    print(summary(ops, args.matmul_tflops, args.bandwidth, args.top))
    by_name = collections.Counter()
    for op in ops:
        by_name[f"{op.phase} {op.name}"] += 0 if op.flops else op.bytes
    run.finish({"matmul_flops": sum(op.flops for op in ops), "other_bytes": sum(op.bytes for op in ops if not op.flops),
                "operators": len(ops), "bytes_by_operator": dict(by_name.most_common(args.top))})


if __name__ == "__main__":
    main()
