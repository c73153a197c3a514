"""The drafter's forward and backward for one batch, replayed from a CUDA graph instead of launched op by op.

A TTT step is a few hundred small kernels per unroll step, most of them too small to keep a large GPU busy for
longer than the host takes to launch the next: the device waits on Python (`bench/train_throughput.py --graph
both` measures it; docs/benchmarks.md). Captured once per length bucket and replayed, a step costs the host one
launch.

    graphed = GraphedTTT(model, grad_scale=1 / grad_accum, batch_tokens=cfg.batch_tokens)
    loss, stats = graphed(batch, autocast)   # gradients added into p.grad, as loss.backward() would

What a replay needs, and how it is kept:
- static shapes: a batch is right-padded to a length bucket (`bucket_length`: 1/8 more positions at most, or 63)
  and, in the trainer, to the rows a batch of that bucket may hold (`graph_shape`), with the padding `collate`
  uses (not valid, not counted: the loss, statistics and gradients are the unpadded batch's up to summation
  order — causal attention never looks right, and padded rows count nothing); one graph per length bucket;
- static gradients: every trainable parameter keeps one `.grad` tensor the graphs add into, so the optimizer
  zeroes them in place (`zero_grad(set_to_none=False)`), never frees them;
- warm-ups before each capture (compiles, autotuning and the allocator happen outside it), with the gradients
  saved and restored around them so the warm-ups train nothing;
- one memory pool shared by every shape's graph, and one set of static input buffers (`SharedInputs`): the graphs
  replay one at a time, each after its batch is copied in, and their outputs are copied out at once, so they can
  share their intermediates' and their inputs' memory. The inputs are mostly aux states (2 B × 3 layers × hidden
  per position: ~0.4 GB for an 8B target at 16k tokens a batch); kept per shape, 21 shapes of a ShareGPT run
  would hold ~8 GB of them.
Several ranks: DDP's all-reduce hooks would not run in a replay, so the ranks' gradients are averaged after the
step instead (hstap.train.gradsync, `hstap train --grad-reduce after`).
A caller must not keep an earlier eager step's graph alive (an undeleted loss) into a capture: autograd reuses the
parameters' AccumulateGrad nodes while a graph holds them, with the stream they were made on, and the capture,
synced with that stream, fails (said once; the run goes on eagerly). The trainer keeps only detached losses.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

from hstap.errors import first_line
from hstap.train.ttt import TTTBatch, batch_tensors

MAX_GRAPHS = 64  # shapes captured (40 buckets reach 8,192 positions); past this, new ones run eagerly
WARMUPS = 2


def bucket_length(length: int) -> int:
    """`length` rounded up to a multiple of 1/8 of its power of two, at least of 64: few distinct shapes to capture
    (40 up to 8,192 positions), at most 1/8 more positions from 512 on and under 64 more below."""
    step = max(64, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


@functools.cache
def _shortest_in_bucket(bucket: int) -> int:
    n = bucket
    while n > 1 and bucket_length(n - 1) == bucket:
        n -= 1
    return n


def graph_shape(rows: int, length: int, batch_tokens: int | None) -> tuple[int, int] | None:
    """The (rows, positions) a batch of `rows` × `length` is padded to. Positions: `bucket_length`. Rows, given the
    trainer's `batch_tokens`: as many as a batch of the bucket's shortest length may hold (`plan_batches` cuts a
    batch where rows × longest would pass `batch_tokens`), so every batch of a bucket — the short last batch of
    each sorting window too — shares one graph; without it (fixed shapes, the benches), the batch's own.

    The shortest length counted is at least half the bucket: the first bucket holds lengths 1 to 64, and rows for
    a batch of 1-token samples would pad a 64-position batch to 64 × `batch_tokens` positions. A graph so computes
    at most twice `batch_tokens` positions (a single sample longer than that aside), and the rare batch of more rows
    than its bucket's graph holds (samples all under 32 tokens) gets None: it runs eagerly."""
    padded = bucket_length(length)
    if batch_tokens is None:
        return rows, padded
    most = max(batch_tokens // max(_shortest_in_bucket(padded), padded // 2), 1)
    return (most, padded) if rows <= most else None


def pad_batch(batch: TTTBatch, length: int, rows: int | None = None) -> TTTBatch:
    """Right-pad every field to `length` positions, and with `rows` add rows of padding only, as `collate` pads
    (zeros, False, −inf log-probs): not valid, never counted."""
    extra = length - batch.input_ids.shape[1]
    more = (rows or batch.input_ids.shape[0]) - batch.input_ids.shape[0]
    if extra == 0 and more == 0:
        return batch

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra, 0, more), value=value)

    return dataclasses.replace(batch, aux=pad(batch.aux, 0.0), input_ids=pad(batch.input_ids, 0),
                               loss_mask=pad(batch.loss_mask, False), valid=pad(batch.valid, False),
                               topk_ids=pad(batch.topk_ids, 0), topk_logprobs=pad(batch.topk_logprobs, -float("inf")))


class SharedInputs:
    """The static input tensors of every captured shape, as views into one flat buffer per batch field.

    The graphs replay one at a time, each right after its batch is copied into its views, so the shapes can share
    the memory. A buffer is made at the first capture, large enough for `positions` positions (the most a graph
    computes); a larger shape later gets a larger buffer, which the shapes after it share."""

    def __init__(self, positions: int | None = None):
        self.positions = positions
        self.buffers: list[torch.Tensor] = []

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views shaped like `tensors`, holding their values (one per batch field, in `batch_tensors` order)."""
        rows, length = tensors[0].shape[:2]
        out = []
        for k, t in enumerate(tensors):
            have = self.buffers[k] if k < len(self.buffers) else None
            if have is None or have.numel() < t.numel() or have.dtype != t.dtype or have.device != t.device:
                per_position = t.numel() // (rows * length)
                size = max(t.numel(), per_position * (self.positions or 0))
                have = torch.empty(size, dtype=t.dtype, device=t.device)
                self.buffers[k:k + 1] = [have]
            out.append(have[:t.numel()].view(t.shape).copy_(t))
        return out


class _Captured:
    """One batch shape: the static inputs the graph reads, the graph, and its static outputs."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.inputs = inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None
        self.stats: torch.Tensor | None = None


class GraphedTTT:
    """`model` (a TTTModel) forward + `(loss * grad_scale).backward()` per batch, from one CUDA graph per length
    bucket. Returns (loss, stats) as fresh tensors, like the eager step's `loss.detach()` and stats. A step that
    cannot be captured costs speed, never the run: the failure is said once on stderr and every later batch runs
    eagerly (its gradients added in the same place)."""

    def __init__(self, model: torch.nn.Module, grad_scale: float = 1.0, batch_tokens: int | None = None):
        self.model, self.grad_scale, self.batch_tokens = model, grad_scale, batch_tokens
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = None  # one memory pool for every graph, made at the first capture
        self.side: torch.cuda.Stream | None = None  # the warm-ups' stream, made at the first capture
        self.inputs = SharedInputs(2 * batch_tokens if batch_tokens else None)  # graph_shape's most positions
        self.failure = ""  # the first capture error's first line, once one happened
        self.said_full = self.said_rows = False

    def __call__(self, batch: TTTBatch, autocast: AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
        if self.failure:
            return self._eager(batch_tensors(batch), autocast)
        shape = graph_shape(*batch.input_ids.shape, self.batch_tokens)
        if shape is None:
            if not self.said_rows:
                print(f"hstap train: a batch of {batch.input_ids.shape[0]} samples of at most "
                      f"{batch.input_ids.shape[1]} tokens has more rows than a CUDA graph holds; such batches run "
                      "eagerly", file=sys.stderr)
                self.said_rows = True
            return self._eager(batch_tensors(batch), autocast)
        padded = pad_batch(batch, shape[1], shape[0])
        key = tuple((t.shape, t.dtype) for t in batch_tensors(padded))
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= MAX_GRAPHS:
                if not self.said_full:
                    print(f"hstap train: {MAX_GRAPHS} batch shapes captured as CUDA graphs; new shapes run eagerly",
                          file=sys.stderr)
                    self.said_full = True
                return self._eager(batch_tensors(batch), autocast)
            try:
                captured = self._capture(padded, autocast)
            except Exception as e:  # noqa: BLE001 — a capture that fails must not end a training run: say so, go on
                self.failure = first_line(e)
                print(f"hstap train: capturing the training step as a CUDA graph failed ({self.failure}); "
                      "continuing without CUDA graphs", file=sys.stderr)
                return self._eager(batch_tensors(batch), autocast)
            self.graphs[key] = captured
        for static, fresh in zip(captured.inputs, batch_tensors(padded)):
            static.copy_(fresh, non_blocking=True)
        captured.graph.replay()
        return captured.loss.clone(), captured.stats.clone()

    def _eager(self, tensors, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast:
            loss, stats = self.model(*tensors)[:2]
        (loss * self.grad_scale).backward()
        return loss.detach(), stats

    def _capture(self, batch: TTTBatch, autocast) -> _Captured:
        for p in self.params:  # the graphs add into these; the optimizer zeroes them in place
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        captured = _Captured(self.inputs.views(batch_tensors(batch)))
        kept = [p.grad.clone() for p in self.params]  # the warm-ups' gradients are thrown away
        if self.side is None:  # one stream for every capture's warm-ups: a new one each time comes round-robin
            self.side = torch.cuda.Stream()  # from torch's pool of 32 and may be the input copies' stream
        side = self.side
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUPS):
                    self._eager(captured.inputs, autocast)
        finally:  # a failed warm-up leaves the gradients as the batches before it made them, too: restored once
            # what it queued on the side stream is done (it adds into the same gradients)
            torch.cuda.current_stream().wait_stream(side)
            with torch.no_grad():
                for p, g in zip(self.params, kept):
                    p.grad.copy_(g)
            del kept
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        captured.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.current_stream()):  # this stream current again, whatever the capture did
            try:
                with torch.cuda.graph(captured.graph, pool=self.pool):  # records only: nothing runs or changes
                    with autocast:
                        loss, stats = self.model(*captured.inputs)[:2]
                    (loss * self.grad_scale).backward()
                    captured.loss, captured.stats = loss.detach(), stats
            except Exception:
                _end_failed_capture(self.pool)
                raise
        return captured


def _end_failed_capture(pool) -> None:
    """After a capture that failed: route the caching allocator's allocations back out of the graph's pool.

    `torch.cuda.graph` ends a capture with `capture_end`, which raises before it ends the pool's allocations when
    the capture was invalidated (an op that reads the host or syncs inside it): the allocator would then keep
    allocating into the pool, defer every freed block that crossed streams until no capture is underway (never:
    a leak each step), and refuse `empty_cache` (the evaluation's own graphs). Nothing to end if it had ended."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except Exception:  # noqa: BLE001 — it had ended (or this torch names it otherwise): nothing left to undo
        pass
