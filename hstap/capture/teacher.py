"""The top-k teacher: the target's top-k log-probabilities per position, without a full-vocabulary log-softmax
and without a full-vocabulary top-k.

    values, ids = topk_logprobs(logits, k=32)    # logits (..., V) any float dtype → (..., k) fp32, (..., k) long

log_softmax(x)_i = (x_i − m) − log Σ_j exp(x_j − m) (m the row max) is monotone in x_i, so the top-k of the raw
logits are the top-k of the log-probs. Two things are left to compute over the vocabulary, and one pass over the
logits gives both: the row's vocabulary is cut into blocks of `block` columns and each block yields its max m_b
and Σ exp(x − m_b). Then
- log Σ_j exp(x_j − m) = log Σ_b s_b · exp(m_b − m), with m = max_b m_b (the usual merge of partial sums);
- the top k values lie in the k blocks with the largest maxima: a value outside them has those k maxima above it
  (ties aside, which only swap equal values), so top-k runs over k·block gathered candidates, not all V columns
  (`hstap.topk`, which the tree drafter's expansion uses too).
On an 8B target (128,256 logits a position) that is 4,096 candidates instead of 128,256: `torch.topk` over the
whole row was most of the teacher's reduction on a GPU (docs/benchmarks.md): a multi-pass radix select.
On CUDA the block pass is one compiled reduction reading the logits once (no fp32 copy); elsewhere it runs a
block of rows at a time (at most `chunk_bytes` of fp32). A batch's fp32 log-probs never exist.

The formula is log_softmax's own, (x − m) − log Σ exp(x − m) in fp32, so the values agree with
`log_softmax(x.float()).topk(k)` to fp32 rounding (only the order of the sum differs); tied logits may come back
in a different order of ids, with equal values. Every path computing a `topk:K` teacher calls this: the capture
tap, the device-resident online trainer and a `hidden` teacher turned into top-k at training time.
"""

from __future__ import annotations

import functools
import warnings

import torch

from hstap.topk import BLOCK, topk_in_best_blocks

CHUNK_BYTES = 256 << 20  # fp32 scratch per block of rows off CUDA: 523 positions of a 128,256-token vocabulary


def topk_logprobs(logits: torch.Tensor, k: int, chunk_bytes: int = CHUNK_BYTES,
                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of each row of `logits` (..., V). Returns values (..., k) fp32, sorted descending, and
    their ids (..., k) long. Extra memory: the (..., k·block) candidates, plus one fp32 block of `chunk_bytes`
    off CUDA. A vocabulary under 2·k·block columns takes top-k over the whole row (nothing to save)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # (T, V), a view for contiguous logits
    whole = vocab // block * block  # columns in whole blocks; the tail past them is its own small block
    maxes, sums = _block_stats(flat, whole, block, chunk_bytes)  # (T, nb [+1]) fp32 each
    peak = maxes.amax(-1, keepdim=True)  # (T, 1) the row max
    logsum = (sums * (maxes - peak).exp()).sum(-1, keepdim=True).log()  # (T, 1) log Σ exp(x − m)
    if 2 * k * block <= vocab:
        best = maxes[:, :whole // block]
        eager = lambda: topk_in_best_blocks(flat, best, k, block)  # noqa: E731
        # compiled on CUDA: several times faster than eager over an 8B prefill's rows (bench/topk_cost.py)
        raw, ids = _compiled_or(topk_in_best_blocks, (flat, best, k, block), eager) if flat.is_cuda else eager()
    else:
        raw, ids = flat.topk(k, dim=-1)
    values = (raw.float() - peak) - logsum  # (T, k)
    return values.view(*logits.shape[:-1], k), ids.view(*logits.shape[:-1], k)


def _stats(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of (T, nb, c) logits: its max and Σ exp(x − max), fp32 (T, nb) each. An all −inf block (a masked
    slice) gives max −inf and sum 0, not NaN."""
    top = blocks.amax(-1, keepdim=True).float()  # (T, nb, 1)
    shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    return top[..., 0], (blocks.float() - shift).exp().sum(-1)  # the subtraction upcasts to fp32


def _block_stats(flat: torch.Tensor, whole: int, block: int, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_stats` of flat's whole blocks and, as one more block, its tail past `whole` (when V is not a multiple of
    `block`): compiled on CUDA, a chunk of rows at a time elsewhere. → maxes, sums (T, nb [+ 1]) fp32."""
    rows = flat.shape[0]
    blocks = flat[:, :whole].reshape(rows, whole // block, block)  # a view of contiguous logits
    eager = lambda: _chunked_stats(blocks, chunk_bytes)  # noqa: E731
    maxes, sums = _compiled_or(_stats, (blocks,), eager) if flat.is_cuda and whole else eager()
    if whole < flat.shape[1]:
        tail_max, tail_sum = _stats(flat[:, None, whole:])  # (T, 1) each
        maxes, sums = torch.cat([maxes, tail_max], 1), torch.cat([sums, tail_sum], 1)
    return maxes, sums


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)  # row counts vary per batch: one kernel for all


_EAGER_ONLY: list[str] = []  # why the compiled steps are not used in this process, once one failed


def _compiled_or(fn, args: tuple, eager):
    """fn(*args) compiled; `eager()` if compilation is unavailable (the same numbers, more memory traffic),
    with a warning, and eagerly from then on in this process."""
    if not _EAGER_ONLY:
        try:
            return _compiled(fn)(*args)
        except Exception as exc:  # noqa: BLE001 — a missing toolchain must not cost the capture its teacher
            _EAGER_ONLY.append(f"{type(exc).__name__}: {exc}")
            warnings.warn(f"top-k teacher: compiled {fn.__name__} unavailable, running eagerly ({_EAGER_ONLY[0]})",
                          stacklevel=3)
    return eager()


def _chunked_stats(blocks: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_stats` a chunk of rows at a time, so its fp32 scratch stays within `chunk_bytes`."""
    rows, count, width = blocks.shape
    maxes = torch.empty(rows, count, device=blocks.device)
    sums = torch.empty_like(maxes)
    per = max(1, chunk_bytes // max(1, 4 * count * width))
    for start in range(0, rows, per):
        maxes[start:start + per], sums[start:start + per] = _stats(blocks[start:start + per])
    return maxes, sums
