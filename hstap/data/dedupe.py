"""Exact and near-duplicate detection for prompts: a normalised-text hash, then word-shingle MinHash with LSH bands.

    dedupe = Deduper(threshold=0.7)
    dedupe.admit("Write a poem about the sea.")      # None: new, now remembered
    dedupe.admit("write a POEM about the sea!")       # "exact_duplicate": same words, case and punctuation aside
    dedupe.admit("Please write a poem about the sea") # "near_duplicate": estimated Jaccard >= 0.7

Why MinHash: a set of prompts grows to ~10^5; comparing every new prompt with every kept one is quadratic, so each
text gets a signature of `num_perm` minima of hashed word shingles (the chance two signatures agree at a position
equals the Jaccard similarity of the two shingle sets), and signatures are bucketed by bands of `rows` values:
two texts become candidates only if one band matches exactly (probability 1 - (1 - J**rows)**bands: 0.99 at
J = 0.7 with 16 bands of 4), and a candidate is a duplicate when its estimated Jaccard reaches the threshold.
Shingles are word pairs by default because prompts are short: one changed word in a 15-word prompt keeps a
pair-Jaccard of 0.75 but a triple-Jaccard of only 0.63. Hashes are crc32 (Python's `hash` is salted per process),
so results are the same on every run.
"""

from __future__ import annotations

import hashlib
import re
import zlib

import numpy as np

from hstap.data.config import NEAR_DUP

_WORD = re.compile(r"\w+")
_PRIME = 4_294_967_311  # the smallest prime above 2**32: shingle hashes (< 2**32) are distinct residues
MAX_WORDS = 2000  # a signature reads this many words: conversations differing only after them are rare


def words(text: str) -> list[str]:
    """Lower-cased word tokens: punctuation, case and spacing never make two prompts different."""
    return _WORD.findall(text.casefold())


def text_key(text: str) -> str:
    """Hash of the normalised text (its words joined by single spaces): equal for exact duplicates."""
    return hashlib.sha1(" ".join(words(text)).encode("utf-8")).hexdigest()[:20]


def shingle_hashes(tokens: list[str], size: int) -> np.ndarray:
    """crc32 of every run of `size` consecutive words -> [S] uint64 (one shingle for a shorter text)."""
    tokens = tokens[:MAX_WORDS]
    runs = [" ".join(tokens[k:k + size]) for k in range(max(1, len(tokens) - size + 1))]
    return np.unique(np.fromiter((zlib.crc32(r.encode("utf-8")) for r in runs), dtype=np.uint64, count=len(runs)))


class MinHasher:
    """`num_perm` universal hash functions h_i(x) = (a_i x + b_i) mod p; a signature keeps each one's minimum."""

    def __init__(self, num_perm: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        # a < 2**31 and x < 2**32 keep a*x + b below 2**64: no uint64 overflow before the modulo
        self.a = rng.integers(1, 2**31, size=(num_perm, 1), dtype=np.uint64)  # [P, 1]
        self.b = rng.integers(0, 2**31, size=(num_perm, 1), dtype=np.uint64)  # [P, 1]

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        """[S] uint64 shingle hashes -> [P] uint64 minima."""
        return ((self.a * hashes[None, :] + self.b) % _PRIME).min(axis=1)  # [P, S] -> [P]


class Deduper:
    """Remembers admitted texts; `admit` refuses an exact or near duplicate of one of them.

    `threshold`: estimated Jaccard of word-shingle sets at or above which a text is a near duplicate;
    `bands` x `rows` = the number of hash functions.
    """

    def __init__(self, threshold: float = NEAR_DUP, shingle: int = 2, bands: int = 16, rows: int = 4, seed: int = 0):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold, self.shingle, self.bands, self.rows = threshold, shingle, bands, rows
        self.hasher = MinHasher(bands * rows, seed)
        self.keys: set[str] = set()
        self.signatures: list[np.ndarray] = []
        self.buckets: dict[tuple[int, bytes], list[int]] = {}

    def __len__(self) -> int:
        return len(self.signatures)

    def admit(self, text: str) -> str | None:
        """None if `text` is new (it is remembered), else "exact_duplicate" or "near_duplicate"."""
        key = text_key(text)
        if key in self.keys:
            return "exact_duplicate"
        sig = self.hasher.signature(shingle_hashes(words(text), self.shingle))
        bands = [(k, sig[k * self.rows:(k + 1) * self.rows].tobytes()) for k in range(self.bands)]
        candidates = {i for band in bands for i in self.buckets.get(band, ())}
        if any(self.similarity(sig, self.signatures[i]) >= self.threshold for i in candidates):
            return "near_duplicate"
        self.keys.add(key)
        for band in bands:
            self.buckets.setdefault(band, []).append(len(self.signatures))
        self.signatures.append(sig)
        return None

    @staticmethod
    def similarity(a: np.ndarray, b: np.ndarray) -> float:
        """Estimated Jaccard similarity of the shingle sets behind two signatures."""
        return float(np.mean(a == b))
