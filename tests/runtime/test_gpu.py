"""The runtime on CUDA (skipped without a GPU): captured graphs give the same greedy tokens as plain decoding in
fp32 — vanilla, n-gram, chain and tree, batch 1 and a batch of rows that accept different counts — and in bf16
the same tokens up to flips at ties within bf16's rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hstap.runtime.decode import Request, decode
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from hstap.runtime.target import Runtime
from tests.runtime.conftest import MAX_NEW, assert_greedy_identity, greedy_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_models(target, drafter):
    return copy.deepcopy(target.model).cuda(), copy.deepcopy(drafter).cuda()


@pytest.fixture(scope="module")
def cuda_references(cuda_models, prompts, target):
    return [greedy_reference(cuda_models[0], p, MAX_NEW, set(target.stop_ids)) for p in prompts]


def test_graph_step_equals_plain_decoding_in_fp32(cuda_models, prompts, target, cuda_references):
    rt = Runtime(cuda_models[0], batch_size=4, max_len=2048, cuda_graphs=True)
    with torch.inference_mode():
        gens = decode(rt, [Request(p, MAX_NEW) for p in prompts], 0, target.stop_ids, "cuda", sync_every=4)
    assert rt.slot.graphs["step"].graph is not None, "the step was captured"
    for gen, ref in zip(gens, cuda_references):
        assert gen.tokens + ([gen.stop_token] if gen.stop_token is not None else []) == ref


@pytest.mark.parametrize("shape", ["ngram:3", "chain:3", "hybrid:3", "hybrid:4,2", "tree:8,8,60"])
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_speculative_equals_plain_decoding_in_fp32(cuda_models, prompts, target, cuda_references, shape,
                                                           batch):
    model, drafter = cuda_models
    dec = SpecDecoder(Runtime(model, batch_size=batch, max_len=2048, cuda_graphs=True), DraftShape.parse(shape),
                      drafter)
    rows = []
    for i in range(0, len(prompts), batch):
        rows += dec.generate(prompts[i: i + batch], MAX_NEW, set(target.stop_ids), 0)
    assert dec.rt.slot.graphs[("verify", dec.tag)].graph is not None, "the verification was captured"
    for row, ref in zip(rows, cuda_references):
        assert row.tokens == ref, f"{shape} at batch {batch} diverged from greedy decoding on cuda"


def test_graphed_ngram_accepts_and_commits_on_cuda(cuda_models, target):
    """Prompt lookup on repeated text: long acceptances go through the captured verification and commit."""
    from hstap.data import render_prompt

    model = cuda_models[0]
    text = "one two three four five six seven eight nine ten"
    prompt = render_prompt([{"role": "user", "content": f"Repeat exactly, three times: {text}"}], target.tokenizer)
    ref = greedy_reference(model, prompt, 48, set(target.stop_ids))
    for shape in ["ngram:4", "ngram:3"]:
        dec = SpecDecoder(Runtime(model, 1, 2048, cuda_graphs=True), DraftShape.parse(shape))
        (row,) = dec.generate([prompt], 48, set(target.stop_ids), 0)
        assert row.tokens == ref and max(row.accepted) >= 3


def test_oracle_trees_commit_on_cuda_without_graphs(cuda_models, prompts, target, cuda_references):
    """The KV gather of reordered tree paths with the CUDA kernels (oracle drafts are planted from the host, so
    this runs the same code without capturing it)."""
    from tests.runtime.test_spec import Oracle

    model, drafter = cuda_models
    oracle = Oracle(prompts, cuda_references, model.config.vocab_size, seed=2)
    dec = SpecDecoder(Runtime(model, 4, 2048, cuda_graphs=False), DraftShape.parse("tree:5,3,30"), drafter,
                      propose=oracle)
    rows = dec.generate(prompts, MAX_NEW, set(target.stop_ids), 0)
    assert [r.tokens for r in rows] == cuda_references and max(a for r in rows for a in r.accepted) >= 3


def test_bf16_graphs_agree_up_to_rounding(cuda_models, prompts, target):
    """bf16: verifying several tokens at once rounds differently from one at a time, so a near tie may flip. Where
    an answer leaves plain decoding's, the two tokens must be the target's top two within bf16's rounding there
    (hstap.evaluate.divergence); a wider margin is a bug. Every row must finish."""
    model, drafter = (copy.deepcopy(m).to(torch.bfloat16) for m in cuda_models)
    rt = Runtime(model, batch_size=4, max_len=2048, cuda_graphs=True)
    with torch.inference_mode():
        plain = decode(rt, [Request(p, MAX_NEW) for p in prompts], 0, target.stop_ids, "cuda", sync_every=4)
    for shape in ["chain:3", "tree:8,8,60"]:
        rows = SpecDecoder(rt, DraftShape.parse(shape), drafter).generate(prompts, MAX_NEW, set(target.stop_ids), 0)
        assert all(r.done for r in rows)
        for prompt, row, g in zip(prompts, rows, plain):
            answer = g.tokens + ([g.stop_token] if g.stop_token is not None else [])
            assert_greedy_identity(rt, prompt, answer, row.tokens, f"{shape} in bf16")


def test_continuous_batching_on_cuda_graphs_equals_plain_decoding_in_fp32(cuda_models, prompts, target,
                                                                        cuda_references):
    """Rows refilled mid-flight on the captured step: eight requests (limits 3..16) through two rows, each answer
    the plain greedy one cut at its limit; the step graph is captured once and replayed for every admission."""
    from collections import deque

    from hstap.runtime.stream import Session

    rt = Runtime(cuda_models[0], batch_size=2, max_len=2048, cuda_graphs=True)
    limits = [16, 3, 12, 5, 16, 7, 9, 4]
    waiting = deque((k, Request(prompts[k % len(prompts)], n)) for k, n in enumerate(limits))
    delivered, failed = {}, []
    with torch.inference_mode():
        Session(rt, 0, target.stop_ids, sync_every=4).run(waiting, lambda: True, delivered.__setitem__,
                                                           lambda tag, exc: failed.append((tag, exc)))
    assert not failed and not waiting and sorted(delivered) == list(range(len(limits)))
    assert rt.slot.graphs["step"].graph is not None, "the step was captured"
    for k, n in enumerate(limits):
        gen = delivered[k]
        assert gen.tokens + ([gen.stop_token] if gen.stop_token is not None else []) == \
            cuda_references[k % len(prompts)][:n], k


def test_engine_on_cuda_batches_statically_unless_asked(cuda_models, target):
    """Static batches are the CUDA default (measured faster at synth's batch size); continuous=True still works."""
    from types import SimpleNamespace

    from hstap.runtime.engine import Engine

    cuda_target = SimpleNamespace(model=cuda_models[0], tokenizer=target.tokenizer)
    for asked, expected in [(None, False), (True, True), (False, False)]:
        engine = Engine(cuda_target, max_batch=2, continuous=asked)
        try:
            assert engine.continuous is expected
            assert len(engine.generate([Request(target.tokenizer("Hello")["input_ids"], 4)])[0].tokens) <= 4
        finally:
            engine.close()
