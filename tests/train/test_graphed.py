"""CUDA-graphed training steps (hstap.train.graphed): the length buckets, the padding that makes a batch fit one
(exact: the loss, statistics and gradients of the unpadded batch), and on CUDA the replayed step equal to the
eager one, gradients accumulated as backward() accumulates them."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hstap.errors import HstapError
from hstap.train.graphed import bucket_length, pad_batch
from hstap.train.ttt import TTTBatch, TTTModel, batch_tensors, ttt_forward
from tests.train.test_attention import FP32, _tiny_drafter


def _batch(b: int, s: int, lengths: list[int], seed: int = 0) -> TTTBatch:
    gen = torch.Generator().manual_seed(seed)
    valid = torch.arange(s)[None] < torch.tensor(lengths)[:, None]  # right padding, as collate pads
    return TTTBatch(aux=torch.randn(b, s, 96, generator=gen) * valid[..., None],
                    input_ids=torch.randint(0, 50, (b, s), generator=gen) * valid,
                    loss_mask=(torch.rand(b, s, generator=gen) < 0.7) & valid, valid=valid,
                    topk_ids=torch.randint(0, 50, (b, s, 6), generator=gen) * valid[..., None],
                    topk_logprobs=torch.log_softmax(torch.randn(b, s, 6, generator=gen), -1).masked_fill(
                        ~valid[..., None], float("-inf")))


def test_buckets_cost_at_most_an_eighth_more_positions_and_few_shapes():
    assert [bucket_length(n) for n in (1, 64, 65, 200, 1000, 1024, 1025, 2048, 2049, 8000)] == \
        [64, 64, 128, 256, 1024, 1024, 1152, 2048, 2304, 8192]
    for n in range(1, 16385):  # 1/8 more from 512 positions on, under 64 more below
        assert n <= bucket_length(n) <= max(n * 1.125, n + 63)
    assert len({bucket_length(n) for n in range(1, 8193)}) == 40  # shapes a run up to 8,192 positions can capture


def test_plan_batches_of_a_run_share_one_graph_per_length_bucket():
    """The trainer's batches (`plan_batches`: sorted windows, cut by padded tokens, a short batch at each window's
    end) over two epochs map to one padded shape per length bucket, never more rows × positions than a batch of
    the bucket's shortest length may hold."""
    from hstap.train.data import plan_batches
    from hstap.train.graphed import graph_shape

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 2048, (6000,), generator=gen).tolist()
    shapes, own, padded = {}, 0, 0
    for epoch in (0, 1):
        for batch in plan_batches(list(range(6000)), lengths, 16384, seed=0, epoch=epoch):
            longest = max(lengths[i] for i in batch)
            rows, length = graph_shape(len(batch), longest, 16384)
            assert rows >= len(batch) and length >= longest
            shapes.setdefault(length, set()).add(rows)
            own, padded = own + len(batch) * longest, padded + rows * length
    assert all(len(rows) == 1 for rows in shapes.values()), shapes
    assert len(shapes) <= len({bucket_length(n) for n in range(8, 2048)})
    assert padded <= 1.15 * own  # what a graph computes beyond the eager batch: measured 1.10x here
    assert graph_shape(3, 21, None) == (3, 64)  # without a token budget (fixed shapes): the batch's own rows


def test_short_samples_never_pad_a_graph_past_twice_the_batch_tokens():
    """The first bucket holds lengths 1 to 64. Its graph holds the rows of a batch of 32-token samples (512 at
    16,384 tokens: 32,768 positions), not of 1-token ones (16,384 rows × 64 positions = 64 × the batch); a batch of
    more rows (samples all under 32 tokens) runs eagerly (None). No graph computes more than twice `batch_tokens`
    positions, but for one sample longer than that."""
    from hstap.train.data import plan_batches
    from hstap.train.graphed import graph_shape

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 200, (3000,), generator=gen).tolist()
    eager = 0
    for batch in plan_batches(list(range(3000)), lengths, 16384, seed=0, epoch=0):
        longest = max(lengths[i] for i in batch)
        shape = graph_shape(len(batch), longest, 16384)
        if shape is None:
            assert longest < 32 and len(batch) > 16384 // 32
            eager += 1
            continue
        assert shape[0] >= len(batch) and shape[1] >= longest and shape[0] * shape[1] <= 2 * 16384
    assert eager == 0  # sorted windows of 1,024 samples: the shortest batch of each reaches past 32 tokens here
    assert graph_shape(600, 20, 16384) is None and graph_shape(512, 31, 16384) == (512, 64)
    assert graph_shape(40, 64, 16384) == (512, 64) and graph_shape(40, 100, 16384) == (252, 128)
    assert graph_shape(1, 20000, 16384) == (1, 20480)  # one sample past the budget: its own rows, as the eager step


def test_every_captured_shape_reads_its_batch_from_one_shared_set_of_buffers():
    """The graphs replay one at a time, so their static inputs are views of one buffer per batch field, sized for
    the most positions a graph computes; a shape past that gets a larger buffer, which the shapes after it share."""
    from hstap.train.graphed import SharedInputs

    shared = SharedInputs(positions=2 * 256)
    small, bucket, larger, after = (batch_tensors(_batch(b, s, [s] * b, seed=k))
                                    for k, (b, s) in enumerate(((2, 64), (4, 128), (3, 320), (1, 64))))
    views = []
    for fresh in (small, bucket):  # each view holds its batch, in its shape and dtype, until the next is copied in
        views.append(shared.views(fresh))
        assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(views[-1], fresh))
    assert not torch.equal(views[0][0], small[0])  # the second batch wrote over the first: one memory
    first = [v.untyped_storage().data_ptr() for v in views[0]]
    assert [v.untyped_storage().data_ptr() for v in views[1]] == first  # one buffer per field, for both shapes
    assert shared.buffers[0].numel() == 2 * 256 * 96  # aux: 96 values a position, for 512 positions
    grown = shared.views(larger)  # 960 positions: past the 512 the buffers were made for
    assert all(torch.equal(v, t) for v, t in zip(grown, larger))
    assert all(v.untyped_storage().data_ptr() != p for v, p in zip(grown, first))
    assert [v.untyped_storage().data_ptr() for v in shared.views(after)] == \
        [v.untyped_storage().data_ptr() for v in grown]


def test_a_padded_batch_trains_exactly_like_the_unpadded_one():
    """Padding to the bucket adds positions and rows that are not valid and not counted; causal attention never
    looks right, so the loss, the per-step statistics and every gradient are the batch's own (fp32 summation
    order)."""
    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    batch = _batch(3, 21, [21, 15, 9])
    padded = pad_batch(batch, bucket_length(21), rows=5)
    assert padded.input_ids.shape == (5, 64) and padded.topk_logprobs[0, 21:].eq(-float("inf")).all()
    assert not padded.valid[:, 21:].any() and not padded.loss_mask[:, 21:].any() and not padded.valid[3:].any()
    params = [p for p in drafter.parameters() if p.requires_grad]
    outs, grads = [], []
    for b in (batch, padded):
        out = ttt_forward(drafter, b, t2d_ids, steps=4, decay=0.8)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, params))
    torch.testing.assert_close(outs[1].loss, outs[0].loss, **FP32)
    torch.testing.assert_close(outs[1].stats, outs[0].stats, **FP32)
    assert torch.equal(outs[1].run_lengths[:3, :21], outs[0].run_lengths)
    for g, g0 in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, g0, **FP32)
    assert pad_batch(padded, 64) is padded and pad_batch(padded, 64, 5) is padded


def test_the_step_copies_nothing_from_the_host_and_never_waits_for_the_device():
    """What a CUDA graph's capture refuses: a tensor built from host data (`torch.tensor(...)` on the device is a
    copy) or a value read back (`.item()`, `int(t)`). None in a TTT step's forward and backward, so the graphed
    trainer captures the step that the eager one runs (a refused capture only falls back, said once: this is
    where the CPU can tell)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    batch = _batch(3, 21, [21, 15, 9])
    with Ops() as ops:
        out = ttt_forward(drafter, batch, t2d_ids, steps=4, decay=0.8)
        out.loss.backward()
    assert "mm" in ops.names and "addmm_" in ops.names  # the probe saw the step (its weight-gradient sums too)
    assert not {"lift_fresh", "_local_scalar_dense", "item", "nonzero"} & set(ops.names)


def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_so_once(capsys):
    """Here the capture fails for real (no CUDA on this machine): the batches run eagerly, unpadded, with the
    eager step's losses and gradients (added into p.grad as backward adds them, scaled as --grad-accum scales), one
    stderr line, and no second attempt."""
    from hstap.train.graphed import GraphedTTT

    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    model = TTTModel(drafter, t2d_ids, steps=3, decay=0.8)
    params = [p for p in drafter.parameters() if p.requires_grad]
    batches = [_batch(2, 30, [30, 27], seed=0), _batch(3, 40, [40, 33, 12], seed=1)]
    eager_losses = []
    for batch in batches:
        loss = model(*batch_tensors(batch))[0]
        (loss / 2).backward()
        eager_losses.append(loss.detach())
    eager_grads = [p.grad.clone() for p in params]
    drafter.zero_grad(set_to_none=True)
    graphed = GraphedTTT(model, grad_scale=1 / 2, batch_tokens=1024)
    losses = [graphed(batch, contextlib.nullcontext())[0] for batch in batches]
    assert graphed.failure and not graphed.graphs
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    for p, g in zip(params, eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hstap train: capturing the training step as a CUDA graph failed ({graphed.failure}); continuing "
                   "without CUDA graphs"]


def test_cuda_graphs_are_refused_off_cuda_in_one_line(tmp_path):
    from hstap.train.config import TrainConfig
    from hstap.train.rundir import preflight

    cfg = TrainConfig(online=True, data="sharegpt", out=tmp_path / "run", cuda_graphs=True, device="cpu")
    with pytest.raises(HstapError, match="--cuda-graphs replays CUDA graphs: it needs --device cuda, not cpu") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)


def test_cuda_graphs_with_ddps_overlapped_all_reduce_are_refused_and_auto_reduces_after(tmp_path):
    """A replayed backward runs no DDP hooks: graphs average the ranks' gradients after the step."""
    from hstap.train.config import TrainConfig
    from hstap.train.rundir import preflight

    cfg = TrainConfig(online=True, data="sharegpt", out=tmp_path / "run", cuda_graphs=True, device="cuda",
                      grad_reduce="overlap")
    with pytest.raises(HstapError, match="--cuda-graphs with --grad-reduce overlap") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)
    assert cfg.model_copy(update={"grad_reduce": "auto"}).reduce_after
    assert not cfg.model_copy(update={"grad_reduce": "auto", "cuda_graphs": False}).reduce_after


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_steps_equal_eager_steps_and_accumulate_like_backward():
    """Two shapes, each replayed twice, gradients added up across the four batches (as --grad-accum adds them):
    equal to the eager forward and backward of the same batches under the same autocast, and the warm-ups
    before each capture train nothing."""
    from hstap.train.graphed import GraphedTTT
    from hstap.train.ttt import autocast

    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    drafter = drafter.cuda()
    model = TTTModel(drafter, t2d_ids.cuda(), steps=3, decay=0.8)
    params = [p for p in drafter.parameters() if p.requires_grad]
    batches = [_batch(2, s, [s, s - 3], seed=k).to("cuda") for k, s in enumerate((30, 100, 31, 97))]
    device = torch.device("cuda")
    eager_losses = []
    for batch in batches:  # at the bucket's length, as the graph runs it (padding is exact: the CPU test above)
        with autocast(device):
            loss = model(*batch_tensors(pad_batch(batch, bucket_length(batch.input_ids.shape[1]))))[0]
        (loss / 4).backward()
        eager_losses.append(loss.detach())
    # the last loss would keep its graph alive, and with it the parameters' AccumulateGrad nodes, made on the default
    # stream: a capture reusing them syncs with that stream and fails (on an H100, 2026-12-05)
    del loss
    eager_grads = [p.grad.clone() for p in params]
    drafter.zero_grad(set_to_none=True)
    graphed = GraphedTTT(model, grad_scale=1 / 4)
    losses = [graphed(batch, autocast(device))[0] for batch in batches]
    assert len(graphed.graphs) == 2  # lengths 30/31 share the 64 bucket, 97/100 the 128 one
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6)
    for p, g in zip(params, eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hstap_train_with_cuda_graphs_trains_like_without(small_store, tmp_path, capsys):
    """`hstap train --cuda-graphs` on the session's small store, two batches a step (--grad-accum 2), against the
    same run without graphs: the same losses to bf16's rounding (the padded batches run other kernel shapes), and
    no capture failed (a failure would have fallen back to eager, said on stderr)."""
    from hstap.train.config import TrainConfig
    from hstap.train.run import load_metrics, run_train

    common = dict(store=small_store, device="cuda", max_steps=6, batch_tokens=512, grad_accum=2, draft_vocab=2048,
                  ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0)
    runs = [run_train(TrainConfig(out=tmp_path / name, cuda_graphs=graphs, **common), progress=False)
            for name, graphs in (("eager", False), ("graphs", True))]
    assert "as a CUDA graph failed" not in capsys.readouterr().err
    losses = [[r["loss"] for r in load_metrics(run.out / "metrics.jsonl") if r["kind"] == "train"] for run in runs]
    assert len(losses[1]) == len(losses[0]) == 5  # one epoch of the small store (max_steps 6 is not reached)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=2e-2, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capture_that_fails_on_the_device_leaves_streams_and_the_allocator_as_they_were(capsys):
    """A step that reads the host inside the capture (here on purpose: `float(loss)`) invalidates it, and
    `torch.cuda.graph` then raises before it ends the pool's allocations or restores the stream. The run goes on
    eagerly with the eager step's gradients, on the stream it was on, and the allocator takes part in a later
    capture (the evaluation's decoding graphs) instead of asserting that one is still underway."""
    from hstap.train.graphed import GraphedTTT
    from hstap.train.ttt import autocast

    class ReadsTheHost(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *tensors):
            out = self.inner(*tensors)
            float(out[0])  # a sync: fine eagerly, refused while capturing
            return out

    torch.manual_seed(0)
    drafter, t2d_ids = _tiny_drafter()
    drafter = drafter.cuda()
    model = ReadsTheHost(TTTModel(drafter, t2d_ids.cuda(), steps=3, decay=0.8))
    params = [p for p in drafter.parameters() if p.requires_grad]
    batches = [_batch(2, s, [s, s - 3], seed=k).to("cuda") for k, s in enumerate((30, 100))]
    device, stream = torch.device("cuda"), torch.cuda.current_stream()
    for batch in batches:
        with autocast(device):
            loss = model(*batch_tensors(batch))[0]
        (loss / 2).backward()
    eager_grads = [p.grad.clone() for p in params]
    drafter.zero_grad(set_to_none=True)
    graphed = GraphedTTT(model, grad_scale=1 / 2, batch_tokens=1024)
    for batch in batches:
        graphed(batch, autocast(device))
    assert graphed.failure and not graphed.graphs and "as a CUDA graph failed" in capsys.readouterr().err
    assert torch.cuda.current_stream() == stream
    for p, g in zip(params, eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    torch.cuda.empty_cache()  # asserts when the allocator still thinks a capture is underway
    x = torch.ones(4, device="cuda")
    again = torch.cuda.CUDAGraph()
    with torch.cuda.graph(again):
        y = x * 2
    again.replay()
    assert torch.equal(y, torch.full((4,), 2.0, device="cuda"))
