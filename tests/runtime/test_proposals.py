"""The runtime's drafter sees exactly what training-time test showed it; tree drafting isolates branches; prompt
lookup finds the longest latest match."""

from __future__ import annotations

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.runtime.proposals import Block, Drafts, _step, draft_chain, draft_ngram, draft_tree, extend
from hstap.runtime.lean_drafter import LeanDrafter
from hstap.train.ttt import TTTAttention
from tests.runtime.conftest import fake_slot

ATOL = dict(atol=1e-5, rtol=1e-5)


def tiny_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4],
                        target_model_id="tiny", target_fingerprint="f", target_num_layers=8, target_hidden_size=32)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        d2t, t2d = build_draft_vocab(torch.arange(50, 0, -1) % 7, 20)
        model.d2t.copy_(d2t), model.t2d.copy_(t2d)
    return model.eval()


@torch.no_grad()
def ttt_logits(model: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training's unroll (as hstap.train.ttt runs it): step k at t reads token t+1+k; → per step (1, S, Vd)."""
    attend = TTTAttention(model.config.num_attention_heads, model.config.num_key_value_heads)
    s = ids.shape[1]
    hidden, pos, out = model.project(aux), torch.arange(s)[None], []
    for k in range(steps):
        tokens = torch.cat([ids[:, 1 + k:], torch.zeros(1, 1 + k, dtype=ids.dtype)], 1)
        hidden, logits = model.step(tokens, hidden, pos + k, attend)
        out.append(logits)
    return out


def _prefilled(lean: LeanDrafter, aux: torch.Tensor, ids: torch.Tensor, pad: int = 0):
    """Drafts holding the step-0 entries of every position of (B, S) aux/ids, left-padded by `pad` columns."""
    b, s = ids.shape
    slot = fake_slot([pad] * b, [s] * b)
    drafts = Drafts(kv=lean.new_cache(b, slot.length), hidden=torch.zeros(b, lean.hidden_size),
                    logits=torch.zeros(b, lean.draft_vocab))
    extend(lean, drafts, slot, aux, ids, torch.full((b,), s), padded_start=True)
    return drafts, slot


@torch.no_grad()
def test_inference_chain_matches_training_time_test():
    model = tiny_drafter()
    lean = LeanDrafter(model)
    s, steps = 10, 3
    aux, ids = torch.randn(1, s, 96), torch.randint(0, 50, (1, s))
    reference = ttt_logits(model, aux, ids, steps)
    for t in range(s - steps):
        pad = 3  # the same entries behind left padding: the padding must be invisible
        padded_aux = torch.cat([torch.randn(1, pad, 96), aux[:, : t + 1]], 1)
        padded_ids = torch.cat([torch.randint(0, 50, (1, pad)), ids[:, 1: t + 2]], 1)
        drafts, slot = _prefilled(lean, padded_aux, padded_ids, pad)
        torch.testing.assert_close(drafts.logits[0], reference[0][0, t], **ATOL)
        hidden = drafts.hidden[:, None]
        for k in range(1, steps):
            seen = torch.ones(1, k, dtype=torch.bool)  # round entries 0..k-1: the chain so far and itself
            hidden, logits = _step(lean, drafts, slot, ids[:, t + 1 + k: t + 2 + k], hidden, k, k - 1, seen)
            torch.testing.assert_close(logits[0, 0], reference[k][0, t], **ATOL)


@torch.no_grad()
def test_extending_in_pieces_equals_extending_at_once():
    lean = LeanDrafter(tiny_drafter())
    aux, ids = torch.randn(1, 9, 96), torch.randint(0, 50, (1, 9))
    whole, _ = _prefilled(lean, aux, ids)
    pieces, slot = _prefilled(lean, aux[:, :4], ids[:, :4])
    for a, b in [(4, 5), (5, 9)]:
        slot.write_at += b - a
        slot.positions = slot.write_at - slot.start
        extend(lean, pieces, slot, aux[:, a:b], ids[:, a:b], torch.tensor([b - a]))
    torch.testing.assert_close(pieces.kv.data[..., :9, :], whole.kv.data[..., :9, :], **ATOL)
    torch.testing.assert_close(pieces.logits, whole.logits, **ATOL)


def _tree_setup(depth: int, topk: int, nodes: int):
    lean = LeanDrafter(tiny_drafter())
    drafts, slot = _prefilled(lean, torch.randn(1, 6, 96), torch.randint(0, 50, (1, 6)))
    block = Block(*(torch.zeros(1, nodes, dtype=torch.long) for _ in range(3)), scores=torch.zeros(1, nodes))
    return lean, drafts, slot, block


@torch.no_grad()
def test_tree_node_scores_are_their_paths_drafted_alone():
    """Each kept node's score is the sum of the drafter's log-probs along its path, evaluated as a lone chain:
    siblings and cousins drafted in the same batched steps never leak into each other's attention."""
    lean, drafts, slot, block = _tree_setup(depth=4, topk=3, nodes=12)
    draft_tree(lean, drafts, slot, block, depth=4, topk=3)
    tokens, parents, depths = block.tokens[0].tolist(), block.parents[0].tolist(), block.depths[0].tolist()
    assert len(tokens) == 12 and all(p < i for i, p in enumerate(parents)) and max(depths) <= 4
    draft_of = {int(t): d for d, t in enumerate(lean.target_ids)}
    for i in range(12):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        logits, hidden, score = drafts.logits[0], drafts.hidden[:, None], 0.0
        for d, node in enumerate(path):
            score += float(torch.log_softmax(logits.float(), -1)[draft_of[tokens[node]]])
            if d + 1 < len(path):
                seen = torch.ones(1, d + 1, dtype=torch.bool)
                hidden, out = _step(lean, drafts, slot, block.tokens[:, node: node + 1], hidden, d + 1, d, seen)
                logits = out[0, 0]
        assert abs(score - float(block.scores[0, i])) < 1e-4, f"node {i}: path {path}"
    best = lean.target_ids[drafts.logits[0].topk(3).indices].tolist()
    # the root's argmax is always kept (at depth 1; the root's top-k comes unsorted, so not always first)
    assert best[0] in [t for t, d in zip(tokens, depths) if d == 1]


@torch.no_grad()
def test_tree_of_width_one_is_the_chain():
    lean, drafts, slot, block = _tree_setup(depth=4, topk=1, nodes=4)
    draft_tree(lean, drafts, slot, block, depth=4, topk=1)
    chain = Block.chain(1, 4, torch.device("cpu"))
    draft_chain(lean, drafts, slot, chain)
    assert block.tokens.tolist() == chain.tokens.tolist() and block.parents[0].tolist() == [-1, 0, 1, 2]


@torch.no_grad()
def test_sampled_chain_records_its_proposals():
    lean, drafts, slot, _ = _tree_setup(depth=1, topk=1, nodes=1)
    chain = Block.chain(1, 3, torch.device("cpu"))
    chain.q = torch.zeros(1, 3, lean.draft_vocab)
    draft_chain(lean, drafts, slot, chain, torch.tensor([0.8]), torch.Generator().manual_seed(0))
    torch.testing.assert_close(chain.q[0, 0], torch.softmax(drafts.logits[0] / 0.8, -1), **ATOL)
    assert all(t in lean.target_ids.tolist() for t in chain.tokens[0].tolist())  # draft ids mapped through d2t


def test_ngram_takes_the_longest_then_latest_match():
    #           col: 0  1  2  3  4  5  6  7  8  9  10 11
    history = torch.tensor([[9, 1, 2, 3, 7, 1, 2, 4, 5, 2, 1, 2, 0, 0, 0, 0]])
    slot = fake_slot([1], [11], length=16)  # column 0 is padding; root (2) at column 11
    block = Block.chain(1, 3, torch.device("cpu"))
    draft_ngram(history, slot, block, match=3)
    # suffix [2, 1, 2] never occurred; [1, 2] did at 1 and 5: the latest (5) wins → tokens from column 7
    assert block.tokens.tolist() == [[4, 5, 2]]
    draft_ngram(history, slot, block, match=1)  # [2] last seen at 9 → columns 10, 11, then the root repeats
    assert block.tokens.tolist() == [[1, 2, 2]]
    draft_ngram(torch.tensor([[3, 4, 5, 6, 0, 0, 0, 0]]), fake_slot([0], [3], length=8), block, match=2)
    assert block.tokens.tolist() == [[6, 6, 6]]  # no match: the root, which verification rejects
