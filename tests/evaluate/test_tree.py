"""Draft shapes, tree masks and EAGLE-2 reranking."""

from __future__ import annotations

import pytest
import torch

from hstap.errors import HstapError
from hstap.evaluate.shapes import DraftShape
from hstap.evaluate.tree import DraftTree, ancestor_mask, rerank, verify_mask

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


@pytest.mark.parametrize("spec, needle", [
    ("beam:3", "chain:K, tree:DEPTH,TOPK,NODES"),  # an unknown kind lists the valid ones
    ("chain:x", "expected chain:K"),
    ("chain:0", "expected chain:K"),
    ("tree:3,2", "expected tree:DEPTH,TOPK,NODES"),
    ("tree:2,2,7", "nodes ≤ topk + (depth-1)·topk² = 6"),
])
def test_parse_errors_say_what_is_expected(spec, needle):
    with pytest.raises(HstapError) as info:
        DraftShape.parse(spec)
    assert needle in str(info.value)


def test_depths_and_children():
    tree = DraftTree(tokens=[10, 11, 12, 13, 14, 15], parents=PARENTS)
    assert tree.depths == [1, 1, 2, 2, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3] and tree.children(5) == []
    with pytest.raises(AssertionError):
        DraftTree(tokens=[1, 2], parents=[1, -1])  # a child before its parent


def test_ancestor_mask():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(PARENTS), expected)


def test_verify_mask_sees_prefix_root_and_ancestors():
    mask = verify_mask(PARENTS, prefix_len=4, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 11)
    allowed = mask[0, 0] == 0
    assert allowed[:, :5].all()  # prefix + root, for every row
    assert not allowed[0, 5:].any()  # the root row sees no draft node
    assert torch.equal(allowed[1:, 5:], ancestor_mask(PARENTS))
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()  # finite: no NaN rows in any backend


def test_rerank_keeps_best_closed_set_depth_by_depth():
    # candidates as EAGLE-2 produces them: depth 1, then children of expanded nodes
    tokens = [100, 101, 102, 103, 104, 105, 106]
    parents = [-1, -1, -1, 0, 0, 1, 3]
    scores = [-0.1, -0.5, -3.0, -0.3, -2.0, -0.6, -0.4]
    tree = rerank(tokens, parents, scores, nodes=5)
    assert tree.tokens == [100, 101, 103, 105, 106]
    assert tree.parents == [-1, -1, 0, 1, 2]


def test_rerank_ties_keep_parent_before_child():
    # a child with log-prob 0 ties its parent; the parent must still be kept first
    tree = rerank([1, 2, 3], [-1, 0, -1], [-1.0, -1.0, -0.5], nodes=2)
    assert tree.tokens == [3, 1] and tree.parents == [-1, -1]
