import pytest
import torch

from hstap.drafter import build_draft_vocab, draft_to_target_ids, grow_draft_vocab, target_to_draft_ids
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


def test_grown_vocab_keeps_every_old_token_and_adds_the_most_frequent_others():
    """The kept tokens stay even where the new counts are low or zero (ids 1 and 6); the new ones are the top
    counts among the rest, ties to the lower id (0 before 5, 7 and 9 at count 4)."""
    counts = torch.tensor([4, 0, 9, 9, 1, 4, 0, 4, 8, 4])
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[1, 3, 6]] = True
    d2t, t2d = grow_draft_vocab(counts, keep, 6)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 6, 8]  # kept 1, 3, 6 + new 2, 8 (9, 8) and 0 (4)
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 3, 6, 8]
    assert torch.equal(grow_draft_vocab(counts, keep, 3)[1], keep)  # the same size: the same vocabulary
    with pytest.raises(HstapError, match=r"draft_vocab_size=2: expected 3\.\.10"):
        grow_draft_vocab(counts, keep, 2)
    with pytest.raises(HstapError, match="draft_vocab_size=11"):
        grow_draft_vocab(counts, keep, 11)


def test_growing_nothing_is_building_and_growing_twice_is_growing_once():
    """Many ties (counts mod 5): from an empty vocabulary the grown one is the built one; grown from a built one, it
    is the one built at the larger size when the kept tokens are the top ones anyway."""
    counts = torch.arange(200) * 7 % 5
    none = torch.zeros(200, dtype=torch.bool)
    for size in (1, 37, 200):
        assert all(torch.equal(a, b) for a, b in zip(grow_draft_vocab(counts, none, size),
                                                     build_draft_vocab(counts, size)))
    _, small = build_draft_vocab(counts, 30)
    assert all(torch.equal(a, b) for a, b in zip(grow_draft_vocab(counts, small, 90), build_draft_vocab(counts, 90)))


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
