"""The graph-replayed prefill (`Runtime.prefill` with graphs: the batch padded to a width bucket, all rows through
one graph per (bucket, aux layers)) against the eager unpadded lean prefill, on the CPU through `rehearse=True`
(the graph path minus the capture) on the real SmolLM2 in fp32: logits, cache rows over the real columns, aux
over the real positions, start/write_at, one graph per bucket, and the eager fallback when the bucket would not
fit the slot. Buckets of 16 and short prompts keep the file at a few seconds."""

from __future__ import annotations

import pytest
import torch

from hstap.runtime.decode import left_pad
from hstap.runtime.target import Runtime

AUX = (1, 14, 26)
BUCKET = 16
# the graph path runs (4, 16) forwards where the eager one runs (3, 13): other GEMM blocking, so fp32 rounding
# through 30 layers moves a logit by ~5e-5 (as in test_prefill.py); a shifted position or a padding key attended
# to moves it by O(1e-1) and more
TOL = dict(atol=2e-4, rtol=1e-4)


def _runtime(target, graphs: bool, **kw) -> Runtime:
    """4 rows (the batches below have 2 or 3: dummy rows), slots of 64 columns."""
    return Runtime(target.model, batch_size=4, max_len=64, cuda_graphs=False, rehearse=graphs, len_bucket=64,
                   prefill_bucket=BUCKET, **kw)


def _batch(target, prompts, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([p[:n] for p, n in zip(prompts, lengths)], target.tokenizer.pad_token_id, "cpu")


@pytest.mark.parametrize("lengths, aux", [((13, 6, 9), AUX), ((15, 7), ())])
def test_graph_prefill_equals_eager_prefill(target, prompts, lengths, aux, request):
    """Both batches land in bucket 16 (widths 13 and 15), with and without aux layers: the graph path answers
    as the eager one over the real columns, its start/write_at are the eager ones shifted by the padding."""
    ids, mask = _batch(target, prompts, lengths)
    rows, width = ids.shape
    eager, graph = _runtime(target, False), _runtime(target, True)
    assert graph.prefill_width(width, 8) == BUCKET and eager.prefill_width(width, 8) == width
    want = eager.prefill(ids, mask, 8, aux_layers=list(aux))
    got = graph.prefill(ids, mask, 8, aux_layers=list(aux))
    want_logits, got_logits = (want[0], got[0]) if aux else (want, got)
    torch.testing.assert_close(got_logits, want_logits, **TOL)
    shift = BUCKET - width
    assert graph.slot.write_at.tolist() == [BUCKET] * 4 and graph.slot.bound == BUCKET
    assert graph.slot.start.tolist() == [s + shift for s in eager.slot.start[:rows].tolist()] + [BUCKET] * (4 - rows)
    for row, n in enumerate(lengths):  # the real columns: [width - n, width) eagerly, shifted by the padding
        torch.testing.assert_close(graph.slot.kv.data[:, row, :, BUCKET - n:BUCKET],
                                   eager.slot.kv.data[:, row, :, width - n:width], **TOL)
    if aux:
        assert got[1].shape == want[1].shape  # the caller's P columns
        for row, n in enumerate(lengths):
            torch.testing.assert_close(got[1][row, width - n:], want[1][row, width - n:], **TOL)
    assert list(graph.slot.graphs) == [("prefill", BUCKET, aux)]


def test_two_widths_of_one_bucket_share_one_graph(target, prompts):
    rt = _runtime(target, True)
    for lengths in ((13, 6), (11, 9)):
        rt.prefill(*_batch(target, prompts, lengths), 8)
    assert list(rt.slot.graphs) == [("prefill", BUCKET, ())]
    assert rt.slot.start[:2].tolist() == [BUCKET - 11, BUCKET - 9]


def test_a_bucket_past_the_slot_falls_back_to_eager(target, prompts):
    """13 + 51 new tokens fill the 64-column slot exactly: bucket 16 would need a second slot, so the prefill stays
    eager at width 13 in the slot it had (nothing captured, no new slot)."""
    rt = _runtime(target, True)
    ids, mask = _batch(target, prompts, (13, 6))
    assert rt.prefill_width(13, 51) == 13
    rt.prefill(ids, mask, 51)
    assert list(rt.slots) == [64] and rt.slot.graphs == {}
    assert rt.slot.write_at.tolist() == [13] * 4 and rt.slot.start[:2].tolist() == [0, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graph_prefill_equals_eager_prefill_on_cuda(target, prompts):
    """The real capture and replay (not the rehearsal) in fp32 on CUDA: logits, aux and the real cache columns as
    the eager lean prefill's, the graph replayed (not recaptured) for a second batch of the same bucket."""
    import copy

    model = copy.deepcopy(target.model).cuda()
    runtimes = [Runtime(model, batch_size=4, max_len=64, cuda_graphs=graphs, len_bucket=64, prefill_bucket=BUCKET)
                for graphs in (False, True)]
    eager, graph = runtimes
    for lengths in ((13, 6, 9), (11, 15, 4)):
        ids, mask = (t.cuda() for t in _batch(target, prompts, lengths))
        width = ids.shape[1]
        want_logits, want_aux = eager.prefill(ids, mask, 8, aux_layers=list(AUX))
        got_logits, got_aux = graph.prefill(ids, mask, 8, aux_layers=list(AUX))
        torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=1e-3)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(got_aux[row, width - n:], want_aux[row, width - n:], atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(graph.slot.kv.data[:, row, :, BUCKET - n:BUCKET],
                                       eager.slot.kv.data[:, row, :, width - n:width], atol=1e-3, rtol=1e-3)
    assert list(graph.slot.graphs) == [("prefill", BUCKET, AUX)]
