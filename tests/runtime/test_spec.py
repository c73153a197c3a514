"""Speculative decoding on the runtime: greedy output equals plain greedy decoding token for token on the real
SmolLM2 (untrained drafter, n-gram, and oracle drafts that are accepted for long paths, in batches whose rows
accept different counts; with real drafting, a flip at a tie within fp32 rounding is allowed and a wider margin
fails), and sampled output keeps the target's distribution exactly on a tiny model."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch

from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder, extend_tokens
from hstap.runtime.target import Runtime
from tests.evaluate.tiny import exact_joint, tiny_drafter, tiny_target
from tests.runtime.conftest import MAX_NEW, assert_greedy_identity


@pytest.fixture(scope="module")
def runtime(target) -> Runtime:
    return Runtime(target.model, batch_size=4, max_len=2048)


def _generate(runtime, drafter, target, prompts, shape, propose=None, max_new=MAX_NEW):
    dec = SpecDecoder(runtime, DraftShape.parse(shape), drafter, propose=propose)
    return dec.generate(prompts, max_new, set(target.stop_ids), target.tokenizer.pad_token_id)


@pytest.mark.parametrize("shape", ["chain:3", "tree:4,3,10", "hybrid:3"])
def test_greedy_equals_plain_decoding(runtime, target, drafter, prompts, references, shape):
    """Real drafting (nearly always rejected by the untrained drafter), two rows of different lengths; the
    oracle test below runs all four through the same loop with long acceptances."""
    rows = _generate(runtime, drafter, target, prompts[:2], shape, max_new=10)
    for prompt, row, ref in zip(prompts, rows, references):
        assert_greedy_identity(runtime, prompt, ref[:10], row.tokens, shape)  # equal, or a flip within rounding
        assert len(row.accepted) == len(row.emitted) and sum(row.emitted) == 9


@pytest.fixture(scope="module")
def rehearsed(target) -> Runtime:
    """One rehearsing runtime for every shape below, as `hstap eval` keeps one for all of its methods: each shape
    still captures (rehearses) its own verification graphs; the prefill graphs, one per set of aux layers, are
    rehearsed by the first shape that needs them instead of once per shape (~3 s of a core)."""
    return Runtime(target.model, batch_size=2, max_len=2048, rehearse=True)


@pytest.mark.parametrize("shape", ["vanilla", "ngram:2", "chain:3", "tree:4,3,12", "hybrid:3,2"])
def test_graph_path_bookkeeping(rehearsed, target, drafter, prompts, references, shape):
    """What the CUDA path does besides capturing — warm-up runs of every graph body with the state restored,
    attention over the whole cache, one cycle launched ahead — leaves the output unchanged (rows of 2; chain
    and tree with oracle drafts, so acceptances and the cache gather run under the rehearsal too)."""
    from hstap.runtime.decode import Request, decode

    runtime = rehearsed
    want = [ref[:10] for ref in references[2:]]
    if shape == "vanilla":
        with torch.inference_mode():
            gens = decode(runtime, [Request(p, 10) for p in prompts[2:]], 0, target.stop_ids, "cpu")
        assert [g.tokens + ([g.stop_token] if g.stop_token is not None else []) for g in gens] == want
        return
    oracle = None if shape.startswith(("ngram", "hybrid")) else Oracle(prompts[2:], want, target.model.config.vocab_size, 3)
    rows = _generate(runtime, drafter, target, prompts[2:], shape, propose=oracle, max_new=10)
    assert [r.tokens for r in rows] == want
    assert ("verify", (shape, 0)) in runtime.slot.graphs
    # the drafter's step-0 entries over the prompt ran from the graph of the prefill's width too
    assert shape.startswith("ngram") or any(k[:2] == ("start", (shape, 0)) for k in runtime.slot.graphs)
    assert oracle is None or max(a for r in rows for a in r.accepted) >= 2


class Oracle:
    """Drafts from the reference answers: right tokens at random depths and positions among wrong siblings.

    Chains: the next K reference tokens, one replaced by a wrong token 30 % of the time. Trees (N nodes): the
    right child among 1-3 children of every on-path node 85 % of the time, in random order, plus wrong
    branches, so accepted nodes are rarely the first rows of the block and the cache gather must reorder."""

    def __init__(self, prompts: list[list[int]], refs: list[list[int]], vocab: int, seed: int):
        self.prompts, self.refs, self.vocab = prompts, refs, vocab
        self.rng = random.Random(seed)

    def _wrong(self, avoid: int | None) -> int:
        while (tok := self.rng.randrange(self.vocab)) == avoid:
            pass
        return tok

    def __call__(self, dec, st, slot) -> None:
        shape, block = dec.shape, st.block
        for b in range(len(self.prompts)):
            done = int(slot.positions[b]) + 1 - len(self.prompts[b])  # generated tokens committed, root included
            truth = self.refs[b][done:] + [None] * shape.depth
            tokens, parents = self._tree(truth, shape) if shape.kind == "tree" else self._chain(truth, shape.depth)
            block.tokens[b] = torch.tensor(tokens)
            block.parents[b] = torch.tensor(parents)
            block.depths[b] = torch.tensor(_depths(parents))

    def _chain(self, truth, k):
        tokens = [t if t is not None else self._wrong(None) for t in truth[:k]]
        if self.rng.random() < 0.3:
            d = self.rng.randrange(k)
            tokens[d] = self._wrong(truth[d])
        return tokens, list(range(-1, k - 1))

    def _tree(self, truth, shape):
        tokens, parents, frontier = [], [], [(-1, True)]
        for d in range(shape.depth):
            nxt = []
            for node, on_path in frontier:
                kids = [(truth[d], True)] if on_path and truth[d] is not None and self.rng.random() < 0.85 else []
                for _ in range(self.rng.randint(1, 3) - len(kids) if on_path else self.rng.randint(0, 1)):
                    kids.append((self._wrong(truth[d] if on_path else None), False))
                self.rng.shuffle(kids)
                for tok, ok in kids:
                    tokens.append(tok)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, ok))
            frontier = nxt
        while len(tokens) < shape.nodes:  # pad with wrong children of the root; cut keeps parents first
            tokens.append(self._wrong(truth[0]))
            parents.append(-1)
        return tokens[: shape.nodes], parents[: shape.nodes]


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


@pytest.mark.parametrize("shape", ["chain:4", "tree:5,3,30"])
def test_greedy_equals_plain_decoding_with_long_acceptances(runtime, target, drafter, prompts, references, shape):
    oracle = Oracle(prompts, references, target.model.config.vocab_size, seed=1)
    rows = _generate(runtime, drafter, target, prompts, shape, propose=oracle)
    accepted = [a for r in rows for a in r.accepted]
    for row, ref in zip(rows, references):
        assert row.tokens == ref, f"{shape} with oracle drafts diverged from greedy decoding"
    tau = sum(sum(r.emitted) for r in rows) / len(accepted)
    print(f"{shape}: oracle τ {tau:.2f}, accepted per forward {collections.Counter(accepted)}")
    assert max(accepted) == DraftShape.parse(shape).depth and tau > 2.0
    assert len({len(r.accepted) for r in rows}) > 1  # rows advanced by different counts in one batch


@pytest.fixture(scope="module")
def repeating(runtime, target):
    """A prompt that makes the target repeat itself, its greedy answer (40 tokens) and `ngram:4`'s decoding of it:
    both tests below read them (computed once, ~1.5 s of a core)."""
    from hstap.data import render_prompt
    from tests.runtime.conftest import greedy_reference

    text = "one two three four five six seven eight nine ten"
    prompt = render_prompt([{"role": "user", "content": f"Repeat exactly, three times: {text}"}], target.tokenizer)
    ref = greedy_reference(target.model, prompt, 40, set(target.stop_ids))
    (lookup,) = _generate(runtime, None, target, [prompt], "ngram:4", max_new=40)
    return prompt, ref, lookup


def test_ngram_accepts_repeated_text(repeating):
    """A prompt that makes the target repeat itself: prompt lookup drafts are accepted, output unchanged."""
    _, ref, row = repeating
    assert row.tokens == ref
    assert max(row.accepted) >= 3 and sum(row.emitted) / len(row.emitted) > 1.5


def test_hybrid_takes_prompt_lookup_where_the_answer_copies(runtime, target, drafter, repeating):
    """The untrained drafter's chain is nearly never accepted; where the target repeats its prompt, the hybrid
    shape drafts what prompt lookup drafts there (`hybrid:4,1`: wherever any suffix matched, as `ngram:4` does),
    so it accepts like `ngram:4` — with the output unchanged."""
    prompt, ref, lookup = repeating
    (hybrid,) = _generate(runtime, drafter, target, [prompt], "hybrid:4,1", max_new=40)
    (chain,) = _generate(runtime, drafter, target, [prompt], "chain:4", max_new=40)
    assert hybrid.tokens == ref == chain.tokens
    tau = {name: sum(r.emitted) / len(r.emitted) for name, r in [("ngram", lookup), ("hybrid", hybrid),
                                                                  ("chain", chain)]}
    assert tau["hybrid"] >= tau["ngram"] - 0.1 and tau["hybrid"] > tau["chain"] + 0.5, tau


def test_extend_tokens_stops_at_stop_token_and_limit():
    out = [5]
    assert extend_tokens(out, [7, 2, 9], {2}, 10) == (2, True) and out == [5, 7, 2]
    out = [5]
    assert extend_tokens(out, [7, 8, 9], {2}, 3) == (2, True) and out == [5, 7, 8]
    out = [5]
    assert extend_tokens(out, [7], {2}, 3) == (1, False)


def _chi2_threshold(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % point of chi-square(df), Wilson–Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("shape", ["chain:2", "tree:2,2,4"])
def test_sampling_reproduces_target_distribution(shape):
    """Joint law of the first 3 tokens at T = 0.7 (27 outcomes) against the target's exact one: tokens 2 and 3
    come from a verification forward, through acceptance or rejection; the drafter can never propose token 1.
    Four rows per batch, so every batch checks rows that accept independently."""
    model = tiny_target()
    dec = SpecDecoder(Runtime(model, batch_size=4, max_len=64, len_bucket=64), DraftShape.parse(shape),
                      tiny_drafter(model))
    temperature, trials, prompt = 0.7, 1600, [0, 1]
    exact = exact_joint(model, prompt, 3, temperature)
    generator = torch.Generator().manual_seed(0)
    counts, accepted = collections.Counter(), collections.Counter()
    for _ in range(trials // 4):
        for row in dec.generate([prompt] * 4, 3, set(), 0, temperature, generator=generator):
            counts[tuple(row.tokens)] += 1
            accepted.update(row.accepted)
    chi2 = sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in exact.items())
    print(f"{shape}: chi2 {chi2:.1f} (df {len(exact) - 1}), accepted per forward {dict(accepted)}")
    assert min(accepted) == 0 and max(accepted) == 2  # both rejection and full acceptance were exercised
    assert chi2 < _chi2_threshold(len(exact) - 1)
