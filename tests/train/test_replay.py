"""Replayed τ (no decoding loop) equals what the runtime's decoding loop measures, token for token and cycle for
cycle, for chains, prompt lookup and the hybrid of the two (fp32, CPU, the real SmolLM2)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from hstap.data import load_mtbench, render_prompt
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.drafter.vocab import target_to_draft_ids
from hstap.train.replay import chain_runs, greedy_answers, lookup, replay
from hstap.evaluate.results import Prompt
from hstap.evaluate.methods import Methods
from hstap.runtime.shapes import DraftShape
from hstap.train.online import DeviceOnlineSource
from hstap.data.render import RenderedSample
from hstap.train.ttt import ttt_forward

NEW = 32


def test_lookup_takes_the_latest_longest_match():
    seq = [5, 6, 7, 9, 5, 6, 8, 1, 5, 6]
    assert lookup(seq, 9, 3, 3) == ([8, 1, 5], 2)  # "5 6" last seen at 4: 8, 1, then 5
    assert lookup(seq, 9, 4, 3) == ([8, 1, 5, 6], 2)  # drafts past the context repeat the root
    assert lookup([1, 2, 3], 2, 2, 3) == ([3, 3], 0)  # no earlier occurrence: the root, rejected


@pytest.fixture(scope="module")
def trained(target, tokenizer):
    """Three MT-bench answers and a drafter that half memorised them (τ well inside (1, 4))."""
    torch.manual_seed(0)
    prompts = [Prompt(q.id, render_prompt(q.messages[:1], tokenizer)) for q in load_mtbench()[:3]]
    answers = greedy_answers(target, prompts, NEW)
    samples = [RenderedSample(a.id, a.tokens, [False] * len(a.prompt) + [True] * len(a.answer)) for a in answers]
    batch = DeviceOnlineSource(target, samples, [1, 14, 26], dtype="fp32").batch([0, 1, 2])
    model = target.model
    cfg = DrafterConfig.from_target(model.config, [1, 14, 26], 1024, target.model_id, target.fingerprint)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(model, *build_draft_vocab(
        torch.bincount(batch.input_ids.flatten(), minlength=model.config.vocab_size), 1024))
    t2d_ids = target_to_draft_ids(drafter.d2t, model.config.vocab_size)
    optim = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(10):
        optim.zero_grad()
        ttt_forward(drafter, batch, t2d_ids, steps=3).loss.backward()
        optim.step()
    return prompts, answers, drafter.eval()


@pytest.fixture(scope="module")
def runs_at(target, trained) -> Callable[[int], list[list[int]]]:
    """`chain_runs` of the trained drafter per chain depth, computed once: chain:3 and both hybrids of depth 3
    replay the same runs (each call is a prefill of the answers and a drafting pass, ~1 s of a core)."""
    _, answers, drafter = trained
    return functools.cache(lambda depth: chain_runs(target, drafter, answers, depth))


@pytest.mark.parametrize("spec", ["chain:3", "ngram:3", "hybrid:3,1", "hybrid:3,2"])
def test_replay_equals_the_decoding_loop(target, trained, runs_at, spec):
    prompts, answers, drafter = trained
    shape = DraftShape.parse(spec)
    runs = runs_at(shape.depth) if shape.uses_drafter else None
    tokens, cycles = replay(answers, runs, shape, NEW)
    methods = Methods(target.model, drafter if shape.uses_drafter else None, len(prompts),
                      max(len(p.ids) for p in prompts) + NEW, [shape])
    gens = methods.run(shape, [p.ids for p in prompts], NEW, set(target.stop_ids))
    assert [g.tokens for g in gens] == [a.answer for a in answers]
    assert (tokens, cycles) == (sum(sum(g.emitted) for g in gens), sum(g.verify_forwards for g in gens))
    assert cycles < sum(len(a.answer) - 1 for a in answers), f"{spec}: nothing accepted, the test proves little"
