"""The drafter's fused step (torch.compile inside graph bodies) drafts what the eager step drafts, keeps greedy
decoding identical, and a compiler failure costs one stderr line, not the decode. On the CPU the compiled path
runs through dynamo and AOTAutograd's aot_eager backend; test_gpu.py's identity tests run inductor on CUDA."""

from __future__ import annotations

import pytest
import torch

from hstap.runtime import graphs
from hstap.runtime.proposals import Block, draft_chain, draft_ngram, draft_tree
from hstap.runtime.lean_drafter import LeanDrafter
from hstap.runtime.graphs import InCapture, graph_body
from hstap.runtime.shapes import DraftShape
from hstap.runtime.spec import SpecDecoder
from hstap.runtime.target import Runtime
from tests.runtime.test_proposals import _prefilled, tiny_drafter

ATOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")


@torch.no_grad()
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_fused_drafting_equals_eager_drafting(aot_eager, kind):
    model = tiny_drafter()
    aux, ids = torch.randn(2, 7, 96), torch.randint(0, 50, (2, 7))
    blocks = []
    for fused in (False, True):
        lean = LeanDrafter(model, fused=fused)
        drafts, slot = _prefilled(lean, aux, ids)
        block = Block.chain(2, 3, torch.device("cpu")) if kind == "chain" else Block(
            *(torch.zeros(2, 10, dtype=torch.long) for _ in range(3)), scores=torch.zeros(2, 10))
        with graph_body():
            if kind == "chain":
                draft_chain(lean, drafts, slot, block)
            else:
                draft_tree(lean, drafts, slot, block, depth=3, topk=3)
        assert lean.fused is fused and lean.fused_failure == ""
        blocks.append((block, drafts))
    (eager, eager_drafts), (fused, fused_drafts) = blocks
    assert torch.equal(fused.tokens, eager.tokens) and torch.equal(fused.parents, eager.parents)
    torch.testing.assert_close(fused_drafts.kv.data, eager_drafts.kv.data, **ATOL)
    if kind == "tree":
        torch.testing.assert_close(fused.scores, eager.scores, **ATOL)


def test_the_fused_path_is_taken_only_inside_captured(aot_eager, monkeypatch):
    lean = LeanDrafter(tiny_drafter(), fused=True)
    calls = []
    compiled = lean._step.compiled
    monkeypatch.setattr(lean._step, "compiled", lambda *a: calls.append(1) or compiled(*a))
    with torch.no_grad():
        drafts, slot = _prefilled(lean, torch.randn(1, 5, 96), torch.randint(0, 50, (1, 5)))
        assert calls == []  # prefill's extend, outside graph bodies: eager (its width changes with every prompt)
        with graph_body():
            draft_chain(lean, drafts, slot, Block.chain(1, 3, torch.device("cpu")))
    assert len(calls) == 2  # the chain's two drafter steps after the root's


def test_a_failing_compile_falls_back_to_the_eager_step_once(monkeypatch, capsys):
    lean = LeanDrafter(tiny_drafter(), fused=True)

    def broken(*args):
        raise RuntimeError("inductor said no\nmore")

    monkeypatch.setattr(lean._step, "compiled", broken)
    reference = LeanDrafter(tiny_drafter(), fused=False)
    aux, ids = torch.randn(1, 5, 96), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        out = []
        for lean_ in (lean, reference):
            drafts, slot = _prefilled(lean_, aux, ids)
            block = Block.chain(1, 3, torch.device("cpu"))
            with graph_body():
                draft_chain(lean_, drafts, slot, block)
            out.append(block.tokens)
    assert torch.equal(out[0], out[1])
    assert not lean.fused and lean.fused_failure == "RuntimeError: inductor said no"
    assert capsys.readouterr().err.strip() == ("hstap: the drafter's fused step failed to compile (RuntimeError: "
                                               "inductor said no); continuing eagerly")


def test_greedy_decoding_with_fused_drafting_equals_plain_decoding(aot_eager, target, drafter, prompts, references):
    """The graph path's rehearsal (warm-ups with the state restored, full-width attention) with the drafting body
    compiled whole and the acceptance after the target's forward compiled, for a chain, a tree and a hybrid: the
    answer is greedy decoding's, and no compile failed."""
    runtime = Runtime(target.model, batch_size=2, max_len=2048, rehearse=True)
    for shape in ("chain:3", "tree:3,2,5", "hybrid:3,2"):
        dec = SpecDecoder(runtime, DraftShape.parse(shape), drafter, fused=True)
        rows = dec.generate(prompts[:2], 10, set(target.stop_ids), target.tokenizer.pad_token_id)
        assert [r.tokens for r in rows] == [ref[:10] for ref in references[:2]], shape
        for part in (dec.drafting, dec.accepting):
            assert part.compiled is not None and part.failure == "", part.failure


def test_fused_prompt_lookup_equals_eager_lookup(aot_eager):
    """Prompt lookup through InCapture inside a graph body drafts what the eager function drafts, on a history
    with repeats (matches of length 3, 2 and 1, and none)."""
    from tests.runtime.conftest import fake_slot

    history = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 0, 0, 0, 0, 0],
                            [1, 2, 3, 4, 1, 2, 9, 9, 9, 2, 0, 0, 0, 0, 0, 0],
                            [3, 3, 4, 5, 6, 7, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    slot = fake_slot([0, 0, 1], [10, 9, 7], length=16)
    lookup = InCapture(draft_ngram, True, "prompt lookup")
    out = []
    for fn, body in ((draft_ngram, False), (lookup, True)):
        block = Block.chain(3, 4, torch.device("cpu"))
        if body:
            with graph_body():
                matched = fn(history, slot, block, 3)
        else:
            matched = fn(history, slot, block, 3)
        out.append((block.tokens.clone(), matched))
    assert lookup.compiled is not None and lookup.failure == ""
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][1].tolist()[0] == 3  # row 0's last three tokens recur


def test_the_eager_suffix_keeps_the_drafter_unfused(drafter, target):
    runtime = Runtime(target.model, batch_size=1, max_len=256)
    assert not SpecDecoder(runtime, DraftShape.parse("chain:3@eager"), drafter).lean.fused
    cuda = target.model.device.type == "cuda"
    dec = SpecDecoder(runtime, DraftShape.parse("chain:3"), drafter)
    assert dec.lean.fused is cuda and (dec.lookup.compiled is not None) is cuda
