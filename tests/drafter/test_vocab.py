import pytest
import torch

from hstap.drafter import build_draft_vocab, draft_to_target_ids, target_to_draft_ids
from hstap.errors import HstapError


def test_draft_vocab_maps_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    chosen = draft_to_target_ids(d2t)
    assert chosen.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending target id
    assert (chosen == torch.arange(4) + d2t).all()  # SGLang/vLLM convention: target = draft + d2t[draft]
    assert t2d.nonzero().flatten().tolist() == chosen.tolist()
    back = target_to_draft_ids(d2t, 8)
    assert back[chosen].tolist() == [0, 1, 2, 3]
    assert (back[~t2d] == -1).all()


def test_ties_are_deterministic_and_size_checked():
    d2t, _ = build_draft_vocab(torch.tensor([1, 1, 1, 1]), 2)
    assert draft_to_target_ids(d2t).tolist() == [0, 1]
    with pytest.raises(HstapError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(4, dtype=torch.long), 5)


def test_token_counts_over_chunks_equal_counting_sample_by_sample(tokenizer, monkeypatch):
    """Real ShareGPT conversations rendered for SmolLM2; the chunked count (chunks of ~500 tokens here, so a
    sample may close a chunk anywhere) equals a plain per-sample bincount over the answer tokens."""
    import hstap.drafter.vocab as vocab
    from hstap.data import open_source, render

    samples = [render(c, tokenizer) for c in open_source("sharegpt", limit=12)]
    masks = [{"input_ids": torch.tensor(s.input_ids), "loss_mask": torch.tensor(s.loss_mask)} for s in samples]
    size = len(tokenizer)
    expected = torch.zeros(size, dtype=torch.long)
    for m in masks:
        for t in m["input_ids"][m["loss_mask"]].tolist():
            expected[t] += 1
    monkeypatch.setattr(vocab, "COUNT_CHUNK", 500)
    assert sum(int(m["loss_mask"].sum()) for m in masks) > 2000, "several chunks"
    assert torch.equal(vocab.count_tokens(iter(masks), size), expected)
