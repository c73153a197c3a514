"""The drafter at inference sees exactly what training-time test showed it, and tree drafting isolates branches."""

from __future__ import annotations

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.evaluate.drafting import DraftState, _DraftRound, draft_chain, draft_tree
from hstap.train.ttt import TTTAttention

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


def test_inference_chain_matches_training_time_test():
    model = tiny_drafter()
    s, steps = 10, 3
    aux = torch.randn(1, s, 96)
    ids = torch.randint(0, 50, (1, s))
    reference = ttt_logits(model, aux, ids, steps)
    for t in range(s - steps):
        state = DraftState(model)
        root = state.extend(aux[:, : t + 1], ids[:, 1: t + 2])  # step-0 entries of positions 0..t
        torch.testing.assert_close(root.logits, reference[0][0, t], **ATOL)
        draft_round, hidden = _DraftRound(state), root.hidden
        for k in range(1, steps):
            out_hidden, logits = draft_round.step([int(ids[0, t + 1 + k])], hidden[None], depth=k, parents=[k - 2])
            torch.testing.assert_close(logits[0], reference[k][0, t], **ATOL)
            hidden = out_hidden[0]


def test_extending_in_pieces_equals_extending_at_once():
    model = tiny_drafter()
    aux, ids = torch.randn(1, 9, 96), torch.randint(0, 50, (1, 9))
    whole = DraftState(model)
    root_whole = whole.extend(aux, ids)
    pieces = DraftState(model)
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        root = pieces.extend(aux[:, a:b], ids[:, a:b])
    assert pieces.length == whole.length == 9
    torch.testing.assert_close(pieces.keys, whole.keys, **ATOL)
    torch.testing.assert_close(root.logits, root_whole.logits, **ATOL)


def test_tree_branches_do_not_see_each_other():
    model = tiny_drafter()
    state = DraftState(model)
    root = state.extend(torch.randn(1, 6, 96), torch.randint(0, 50, (1, 6)))
    h2 = root.hidden[None].expand(2, -1)
    # one round: two siblings a, b at depth 1, then a child of each at depth 2
    shared = _DraftRound(state)
    hid1, _ = shared.step([7, 9], h2, depth=1, parents=[-1, -1])
    _, logits2 = shared.step([11, 13], hid1, depth=2, parents=[0, 1])
    for branch, (tok1, tok2) in enumerate([(7, 11), (9, 13)]):  # each path alone
        alone = _DraftRound(state)
        h, _ = alone.step([tok1], root.hidden[None], depth=1, parents=[-1])
        _, logits = alone.step([tok2], h, depth=2, parents=[0])
        torch.testing.assert_close(logits2[branch], logits[0], **ATOL)
    assert state.length == 6  # drafting never writes into the step-0 cache


def test_greedy_tree_of_width_one_is_the_chain():
    model = tiny_drafter()
    state = DraftState(model)
    root = state.extend(torch.randn(1, 6, 96), torch.randint(0, 50, (1, 6)))
    chain = draft_chain(state, root, 4)
    tree = draft_tree(state, root, depth=4, topk=1, nodes=4)
    assert tree.tokens == chain.tokens and tree.parents == chain.parents == [-1, 0, 1, 2]


def test_tree_draft_shape_and_first_level():
    model = tiny_drafter()
    state = DraftState(model)
    root = state.extend(torch.randn(1, 6, 96), torch.randint(0, 50, (1, 6)))
    tree = draft_tree(state, root, depth=4, topk=3, nodes=12)
    assert len(tree) == 12 and max(tree.depths) <= 4
    assert tree.depths == sorted(tree.depths)  # depth by depth, parents first
    best = state.target_ids[root.logits.topk(3).indices].tolist()
    assert tree.tokens[0] == best[0]  # the root's argmax is always kept
    assert set(tree.tokens[i] for i in tree.children(-1)) <= set(best)
    assert all(tok in state.target_ids.tolist() for tok in tree.tokens)  # draft ids mapped through d2t


def test_sampled_chain_records_its_proposals():
    model = tiny_drafter()
    state = DraftState(model)
    root = state.extend(torch.randn(1, 6, 96), torch.randint(0, 50, (1, 6)))
    chain = draft_chain(state, root, 3, temperature=0.8, generator=torch.Generator().manual_seed(0))
    q0 = chain.proposals[0]
    assert q0.shape == (50,) and abs(float(q0.sum()) - 1) < 1e-5
    assert torch.equal(q0 > 0, model.t2d)  # mass only on the draft vocabulary, in target ids
    expected = torch.softmax(root.logits / 0.8, -1)
    torch.testing.assert_close(q0[state.target_ids], expected, **ATOL)
