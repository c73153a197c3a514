"""Deduper: exact duplicates by normalised text, near duplicates by MinHash, checked against exact Jaccard."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hstap.data.dedupe import Deduper, MinHasher, shingle_hashes, text_key, words


def jaccard(a: str, b: str, size: int = 2) -> float:
    """Exact Jaccard of the word-shingle sets: the reference the MinHash estimate is checked against."""
    sa, sb = set(shingle_hashes(words(a), size).tolist()), set(shingle_hashes(words(b), size).tolist())
    return len(sa & sb) / len(sa | sb)


@pytest.mark.parametrize("first,second,expected", [
    ("Write a poem about the sea.", "write a POEM   about the sea!", "exact_duplicate"),
    ("Can you give me an example of a Python function to find the max of a list?",
     "Can you give me an example of a Python function to find the maximum of a list?", "near_duplicate"),
    ("Please explain how a hash map handles collisions, with an example in Python code.",
     "Please explain how a hash map handles collisions, with an example in Java code.", "near_duplicate"),
    ("Write a poem about the sea.", "Write a poem about the moon.", None),  # same form, another subject
    ("What is the capital of France?", "How do I sort a list in Python?", None),
])
def test_admit(first, second, expected):
    dedupe = Deduper(threshold=0.7)
    assert dedupe.admit(first) is None
    assert dedupe.admit(second) == expected
    assert len(dedupe) == (2 if expected is None else 1), "a duplicate is not remembered"


def test_text_key_ignores_case_spacing_and_punctuation():
    assert text_key("Hello,   World!") == text_key("hello world") != text_key("hello there world")


def test_minhash_estimates_jaccard():
    """Pairs sharing a random part of a word sequence: the estimate from 256 hashes stays within 0.1 of the exact
    Jaccard (its standard error is at most 0.5 / sqrt(256) = 0.03)."""
    rng = random.Random(0)
    vocab = [f"w{k}" for k in range(500)]
    hasher = MinHasher(num_perm=256, seed=3)
    for _ in range(30):
        base = [rng.choice(vocab) for _ in range(60)]
        other = [w if rng.random() < rng.random() else rng.choice(vocab) for w in base]
        a, b = " ".join(base), " ".join(other)
        sa, sb = (hasher.signature(shingle_hashes(words(t), 2)) for t in (a, b))
        assert abs(Deduper.similarity(sa, sb) - jaccard(a, b)) < 0.1


def test_signatures_are_the_same_in_every_process():
    """crc32 shingles and a seeded generator: no salted hash() anywhere (values pinned on 2026-11-30; a change
    means a new numpy changed its generator, and prompt sets built before would dedupe differently)."""
    sig = MinHasher(num_perm=4, seed=0).signature(shingle_hashes(words("the quick brown fox"), 2))
    assert sig.dtype == np.uint64 and sig.tolist() == [2746629493, 1172927807, 362171779, 129716830]


def test_short_texts_and_threshold_bounds():
    dedupe = Deduper(threshold=1.0)
    assert dedupe.admit("one") is None and dedupe.admit("two") is None
    with pytest.raises(ValueError, match="threshold"):
        Deduper(threshold=0.0)
