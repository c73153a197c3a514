"""The top-k teacher: the target's top-k log-probabilities per position, without a full-vocabulary log-softmax.

    values, ids = topk_logprobs(logits, k=32)    # logits (..., V) any float dtype → (..., k) fp32, (..., k) long

log_softmax(x)_i = (x_i − m) − log Σ_j exp(x_j − m) (m the row max) is monotone in x_i, so the top-k of the raw
logits are the top-k of the log-probs, and top-k's first value is m: only one scalar per row, log Σ exp(x − m),
is left to compute over the vocabulary. On CUDA that is one compiled reduction reading the logits once (no fp32
copy); elsewhere it is summed a block of rows at a time (at most `chunk_bytes` of fp32). Either way a batch's
fp32 log-probs never exist: an 8B prefill of 8,192 positions × 128,256 logits used to write 4.2 GB of them and
run top-k over them, which cost 10 % of the prefill on an H200 (docs/benchmarks.md).

The formula is log_softmax's own, (x − m) − log Σ exp(x − m) in fp32, so the values agree with
`log_softmax(x.float()).topk(k)` to fp32 rounding (only the order of the sum differs); tied logits may come back
in a different order of ids, with equal values. Every path computing a `topk:K` teacher calls this: the capture
tap, the device-resident online trainer and a `hidden` teacher turned into top-k at training time.
"""

from __future__ import annotations

import functools
import warnings

import torch

CHUNK_BYTES = 256 << 20  # fp32 scratch per block of rows off CUDA: 523 positions of a 128,256-token vocabulary


def topk_logprobs(logits: torch.Tensor, k: int, chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of each row of `logits` (..., V). Returns values (..., k) fp32, sorted descending, and
    their ids (..., k) long. Extra memory: the (..., k) results, plus one fp32 block of `chunk_bytes` off CUDA."""
    top = logits.topk(k, dim=-1)  # (..., k) on the raw logits, in their own dtype
    flat = logits.reshape(-1, logits.shape[-1])  # (T, V), a view for contiguous logits
    peak = top.values.reshape(-1, k)[:, :1].float()  # (T, 1) the row max
    logsum = _fused_logsum(flat, peak) if logits.is_cuda else _chunked_logsum(flat, peak, chunk_bytes)  # (T, 1)
    values = (top.values.reshape(-1, k).float() - peak) - logsum  # (T, k)
    return values.view(top.values.shape), top.indices


def _logsum(block: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """log Σ exp(x − m) per row, in fp32: block (c, V) any float dtype, peak (c, 1) fp32 → (c, 1)."""
    return (block - peak).exp_().sum(-1, keepdim=True).log_()  # the subtraction upcasts to fp32


def _chunked_logsum(flat: torch.Tensor, peak: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    logsum = torch.empty_like(peak)  # (T, 1)
    rows = max(1, chunk_bytes // (4 * flat.shape[-1]))
    for start in range(0, flat.shape[0], rows):
        logsum[start:start + rows] = _logsum(flat[start:start + rows], peak[start:start + rows])
    return logsum


@functools.cache
def _compiled_logsum():
    return torch.compile(_logsum, dynamic=True)  # row counts vary per batch: one kernel for all


_EAGER_ONLY: list[str] = []  # why the compiled reduction is not used in this process, once it failed


def _fused_logsum(flat: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """`_logsum` compiled into one reduction over the logits; the chunked form if compilation is unavailable
    (the same numbers, more memory traffic), with a warning."""
    if not _EAGER_ONLY:
        try:
            return _compiled_logsum()(flat, peak)
        except Exception as exc:  # noqa: BLE001 — a missing toolchain must not cost the capture its teacher
            _EAGER_ONLY.append(f"{type(exc).__name__}: {exc}")
            warnings.warn(f"top-k teacher: compiled log-sum-exp unavailable, using the chunked one ({_EAGER_ONLY[0]})",
                          stacklevel=2)
    return _chunked_logsum(flat, peak, CHUNK_BYTES)
