"""bench/step_ops.py's operator census of a training step (fake tensors, the CUDA route): what it counts, and what
it shows about the step — the TTT steps' weight gradients summed inside the matmuls leave no weight-sized adds
(autograd's form has one per step per weight), for the same matmul FLOPs."""

from __future__ import annotations

import step_ops

SMALL = dict(shape="smollm2", draft_vocab=512, seq=64, batch=2, ttt_steps=3)


def _weight_adds(ops, shapes) -> int:
    return sum(op.name in ("add", "add_") and op.phase == "backward" and op.outputs[0][0] in shapes for op in ops)


def test_weight_gradients_summed_in_the_matmuls_leave_no_weight_sized_adds():
    d = step_ops.SHAPES["smollm2"]
    h, i, hd = d["hidden_size"], d["intermediate_size"], d["head_dim"]
    qkv = ((d["num_attention_heads"] + 2 * d["num_key_value_heads"]) * hd, 2 * h)
    weights = {qkv, (2 * i, h), (h, d["num_attention_heads"] * hd), (h, i)}  # q/k/v, gate/up, o, down
    gemm = step_ops.trace_step(**SMALL, wgrad="gemm")
    auto = step_ops.trace_step(**SMALL, wgrad="autograd")
    assert _weight_adds(gemm, weights) == 0
    assert _weight_adds(auto, weights) == 4 * (SMALL["ttt_steps"] - 1)  # each weight, each step after the first
    assert sum(op.flops for op in gemm) == sum(op.flops for op in auto) > 0
    moved = lambda ops: sum(op.bytes for op in ops if not op.flops)  # noqa: E731
    assert moved(gemm) < moved(auto)


def test_the_census_counts_each_kernel_once_forward_and_backward():
    ops = step_ops.trace_step(**SMALL)
    calls = lambda name: sum(op.name == name for op in ops)  # noqa: E731
    steps = SMALL["ttt_steps"]
    assert calls("flex attention") == calls("flex attention.backward") == steps
    assert calls("diagonal merge") == calls("diagonal merge.backward") == steps - 1  # step 0 has no diagonal key
    assert calls("rms_norm") == 4 * steps and calls("swiglu") == steps
    assert calls("head loss block") == 1  # the steps' rows in one block at this size
    assert calls("fused AdamW") == 1
    assert not any(op.name in step_ops.VIEWS or op.name.startswith("empty") for op in ops)
    summary = step_ops.summary(ops, 720.0, 3.3, 5)
    assert summary.splitlines()[0].startswith("matmuls: ") and "fused AdamW" in summary
