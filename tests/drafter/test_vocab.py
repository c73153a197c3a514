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
