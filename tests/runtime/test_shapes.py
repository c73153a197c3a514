"""Draft shapes, the cache's block masks and tree ancestry, the KV commit gather, and greedy acceptance."""

from __future__ import annotations

import pytest
import torch

from hstap.errors import HstapError
from hstap.runtime.accept import greedy_accept
from hstap.runtime.kv import KVCache, ancestors, block_mask, with_root
from hstap.runtime.shapes import DraftShape

#        root
#       /    \
#      0      1
#     / \      \
#    2   3      4
#    |
#    5
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_parse_shapes():
    assert DraftShape.parse("chain:3") == DraftShape(kind="chain", depth=3, topk=1, nodes=3)
    tree = DraftShape.parse("tree:8,8,60")
    assert (tree.depth, tree.topk, tree.nodes, tree.spec) == (8, 8, 60, "tree:8,8,60")
    assert DraftShape.parse(tree.spec) == tree
    ngram = DraftShape.parse("ngram:3")
    assert (ngram.depth, ngram.nodes, ngram.match, ngram.spec, ngram.uses_drafter) == (3, 3, 3, "ngram:3", False)
    assert DraftShape.parse("ngram:5,2").spec == "ngram:5,2"
    eager = DraftShape.parse("tree:8,8,60@eager")  # the same draft, the drafter's steps unfused
    assert eager.eager and eager.spec == "tree:8,8,60@eager" and eager.model_copy(update={"eager": False}) == tree
    assert DraftShape.parse(eager.spec) == eager and not tree.eager


@pytest.mark.parametrize("spec, needle", [
    ("beam:3", "chain:K, tree:DEPTH,TOPK,NODES, ngram:K[,N]"),  # an unknown kind lists the valid ones
    ("chain:x", "expected chain:K"),
    ("chain:0", "expected chain:K"),
    ("tree:3,2", "expected tree:DEPTH,TOPK,NODES"),
    ("tree:2,2,7", "nodes ≤ topk + (depth-1)·topk² = 6"),
    ("ngram:3,0", "expected ngram:K[,N]"),
    ("chain:3@fast", "the only suffix is @eager"),
])
def test_parse_errors_say_what_is_expected(spec, needle):
    with pytest.raises(HstapError) as info:
        DraftShape.parse(spec)
    assert needle in str(info.value)


def test_ancestors():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestors(torch.tensor([PARENTS]), depth=3)[0], expected)
    assert not torch.equal(ancestors(torch.tensor([PARENTS]), depth=2)[0], expected)  # depth bounds the walk


def test_block_mask_sees_own_prefix_and_tree():
    tree = with_root(ancestors(torch.tensor([PARENTS, PARENTS]), depth=3))  # (2, 7, 7)
    start, write_at = torch.tensor([2, 0]), torch.tensor([5, 3])  # row 0: padding 0..1, tokens 2..4
    mask = block_mask(start, write_at, 16, tree, torch.float32)
    assert mask.shape == (2, 1, 7, 16)
    allowed = mask[:, 0] == 0
    assert not allowed[0, :, :2].any() and allowed[0, :, 2:5].all()  # padding hidden, prefix seen by every row
    assert torch.equal(allowed[0, :, 5:12], tree[0]) and not allowed[0, :, 12:].any()
    assert allowed[1, :, :3].all() and torch.equal(allowed[1, :, 3:10], tree[1])
    assert (mask[~allowed[:, None]] == torch.finfo(torch.float32).min).all()  # finite: no NaN in any backend


def test_commit_moves_accepted_rows_into_place_for_every_layer():
    kv = KVCache(layers=2, batch=2, kv_heads=1, length=12, head_dim=1, dtype=torch.float32, device="cpu")
    kv.data.copy_(torch.arange(12.0)[:, None].expand_as(kv.data))  # every slot holds its own column index
    kv.commit(torch.tensor([3, 5]), torch.tensor([[0, 2, 5], [0, 1, 4]]))  # row 0: block at 3, path rows 2, 5
    assert kv.data[:, 0, 0, :, 0].tolist() == [[0, 1, 2, 3, 5, 8, 6, 7, 8, 9, 10, 11]] * 4
    assert kv.data[:, 1, 0, :, 0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 9, 8, 9, 10, 11]] * 4


def test_greedy_accept_follows_the_argmax_path():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([PARENTS])
    # the target's argmax after each block row [root, 0..5]: root → 11 (node 1), node 1 → 14 (node 4), node 4 → 7
    choice = torch.tensor([[11, 12, 14, 0, 0, 7, 0]])
    count, path, bonus = greedy_accept(tokens, parents, 3, choice)
    assert count.tolist() == [2] and path[0, :2].tolist() == [1, 4] and bonus.tolist() == [7]
    choice = torch.tensor([[9, 12, 14, 0, 0, 7, 0]])  # nothing matches at depth 1: the bonus is the root's argmax
    count, _, bonus = greedy_accept(tokens, parents, 3, choice)
    assert count.tolist() == [0] and bonus.tolist() == [9]
    twins = torch.tensor([[10, 10]])  # two children with the same token: only the first is taken
    count, path, _ = greedy_accept(twins, torch.tensor([[-1, -1]]), 1, torch.tensor([[10, 3, 4]]))
    assert count.tolist() == [1] and path[0, 0].item() == 0
