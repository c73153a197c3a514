"""The length-bucketed batch plan and the held-out split: budgets, coverage, windows, determinism, stability."""

from __future__ import annotations

import math
import random

import pytest

from hstap.train.data import plan_batches, split_heldout

HUGE = 10**12  # a token budget every window fits in: each batch of the plan is then one whole bucket window


def random_lengths(n: int, seed: int = 7, longest: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, longest) for _ in range(n)]


def padded(batch: list[int], lengths: list[int]) -> int:
    """Tokens the batch takes once right-padded to its longest sample."""
    return len(batch) * max(lengths[i] for i in batch)


def as_set(batches: list[list[int]]) -> set[frozenset[int]]:
    """The batches with the final batch shuffle (and the order of equal lengths inside one) taken out."""
    return {frozenset(b) for b in batches}


# (n samples, batch_tokens, bucket): the random-length layouts the property tests run on
LAYOUTS = [
    pytest.param(300, 4096, 64, id="300-samples-4k-tokens-bucket-64"),
    pytest.param(50, 1000, 8, id="tight-budget-many-samples-alone"),
    pytest.param(1000, 16384, 128, id="1000-samples-16k-tokens-bucket-128"),
    pytest.param(7, HUGE, 64, id="fewer-samples-than-one-bucket"),
    pytest.param(130, 6000, 1, id="bucket-of-one"),
]


@pytest.mark.parametrize("n, batch_tokens, bucket", LAYOUTS)
def test_padded_batch_fits_the_budget_unless_alone(n, batch_tokens, bucket):
    lengths = random_lengths(n)
    plan = plan_batches(list(range(n)), lengths, batch_tokens, seed=0, epoch=0, bucket=bucket)
    for batch in plan:
        assert len(batch) == 1 or padded(batch, lengths) <= batch_tokens, (batch, padded(batch, lengths))


@pytest.mark.parametrize("n, batch_tokens, bucket", LAYOUTS)
def test_one_rank_plan_covers_every_index_once(n, batch_tokens, bucket):
    lengths = random_lengths(n)
    plan = plan_batches(list(range(n)), lengths, batch_tokens, seed=3, epoch=1, bucket=bucket)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(n))
    assert all(plan), "no empty batch"


def test_plan_uses_only_the_given_indices_and_leaves_them_unchanged():
    lengths = random_lengths(200)
    indices = list(range(1, 200, 3))
    before = indices[:]
    plan = plan_batches(indices, lengths, 4096, seed=0, epoch=0)
    assert indices == before, "plan_batches must not shuffle the caller's list"
    assert sorted(i for b in plan for i in b) == sorted(indices)


@pytest.mark.parametrize("world_size", [2, 3, 8], ids=lambda w: f"world-{w}")
def test_ranks_get_equal_batch_counts_by_dropping_the_last_few(world_size):
    lengths = random_lengths(500)
    one = plan_batches(list(range(500)), lengths, 4096, seed=1, epoch=2, world_size=1)
    many = plan_batches(list(range(500)), lengths, 4096, seed=1, epoch=2, world_size=world_size)
    assert len(many) % world_size == 0
    assert len(many) == len(one) - len(one) % world_size
    assert many == one[:len(many)], "the same plan, only its tail dropped"
    flat = [i for b in many for i in b]
    assert len(flat) == len(set(flat)), "an index appears at most once"


def test_world_size_above_the_batch_count_leaves_nothing():
    assert plan_batches([0, 1, 2], [5, 5, 5], 100, seed=0, epoch=0, world_size=4) == []


def test_same_seed_and_epoch_give_the_same_plan_others_differ():
    lengths = random_lengths(400)
    idx = list(range(400))
    plan = plan_batches(idx, lengths, 4096, seed=5, epoch=3)
    assert plan_batches(idx, lengths, 4096, seed=5, epoch=3) == plan
    assert plan_batches(idx, lengths, 4096, seed=5, epoch=4) != plan
    assert plan_batches(idx, lengths, 4096, seed=6, epoch=3) != plan
    # another epoch draws other windows, so not merely the same batches in another order
    assert as_set(plan_batches(idx, lengths, 4096, seed=5, epoch=4)) != as_set(plan)


@pytest.mark.parametrize("n, batch_tokens, bucket", LAYOUTS)
def test_batches_come_from_one_bucket_window_cut_greedily_in_length_order(n, batch_tokens, bucket):
    """With an unlimited budget every window is one batch (the window shuffle does not depend on the budget), so
    those batches are the windows; with the real budget each batch must sit inside one of them, sorted by length,
    and a batch is only cut when the window's next-longer sample would overflow the budget."""
    lengths = random_lengths(n)
    idx = list(range(n))
    windows = [set(w) for w in plan_batches(idx, lengths, HUGE, seed=2, epoch=0, bucket=bucket)]
    assert sorted(map(len, windows), reverse=True) == [bucket] * (n // bucket) + ([n % bucket] if n % bucket else [])

    plan = plan_batches(idx, lengths, batch_tokens, seed=2, epoch=0, bucket=bucket)
    by_window: dict[int, list[list[int]]] = {}
    for batch in plan:
        home = [w for w, members in enumerate(windows) if set(batch) <= members]
        assert len(home) == 1, f"batch {batch} spans windows"
        by_window.setdefault(home[0], []).append(batch)
        assert [lengths[i] for i in batch] == sorted(lengths[i] for i in batch)
    for w, batches in by_window.items():
        assert set().union(*batches) == windows[w]
        batches.sort(key=lambda b: (lengths[b[0]], lengths[b[-1]]))
        for prev, nxt in zip(batches, batches[1:]):
            assert lengths[prev[-1]] <= lengths[nxt[0]], "batches of a window are contiguous length ranges"
            assert padded(prev + [nxt[0]], lengths) > batch_tokens, "cut before the budget was reached"


# One window (n <= bucket) of distinct lengths, or ties that end up in one batch: the cuts are then independent of
# the shuffle, and the batches are compared as sets. Expected batches worked out by hand.
EXACT = [
    pytest.param([3, 1, 2], 9, {(0, 1, 2)}, id="all-fit-exactly-3x3"),
    pytest.param([3, 1, 2], 8, {(1, 2), (0,)}, id="one-token-short-cuts-the-longest"),
    pytest.param([10, 20, 30, 40, 50], 60, {(0, 1), (2,), (3,), (4,)}, id="10-50-by-60"),
    pytest.param([10, 20, 30, 40, 50], 100, {(0, 1, 2), (3, 4)}, id="10-50-by-100"),
    pytest.param([100, 5], 50, {(1,), (0,)}, id="over-budget-sample-alone"),
    pytest.param([2, 2, 2, 10], 20, {(0, 1, 2), (3,)}, id="longest-sets-the-padding"),
    pytest.param([2, 2, 2, 5], 20, {(0, 1, 2, 3)}, id="4x5-fits-20"),
    pytest.param([7], 1, {(0,)}, id="single-sample-over-budget"),
    pytest.param([], 100, set(), id="no-samples"),
]


@pytest.mark.parametrize("lengths, batch_tokens, expected", EXACT)
def test_exact_batches_for_hand_made_lengths(lengths, batch_tokens, expected):
    plan = plan_batches(list(range(len(lengths))), lengths, batch_tokens, seed=0, epoch=0)
    assert {tuple(sorted(b)) for b in plan} == expected
    assert len(plan) == len(expected)


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 0), (0, 1), (123, 9)], ids=lambda v: str(v))
def test_exact_batches_hold_for_any_shuffle(seed, epoch):
    plan = plan_batches([0, 1, 2, 3, 4], [10, 20, 30, 40, 50], 100, seed=seed, epoch=epoch)
    assert {tuple(sorted(b)) for b in plan} == {(0, 1, 2), (3, 4)}


def test_subset_indices_are_cut_by_their_own_lengths():
    lengths = [1, 1, 1, 1, 5, 1]
    assert plan_batches([4, 2], lengths, 10, seed=0, epoch=0) == [[2, 4]]  # 2 × 5 = 10 fits, sorted by length


# ---- split_heldout -------------------------------------------------------------------------------------------

IDS = [f"sample-{i}" for i in range(2000)]


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 0.999], ids=lambda f: f"fraction-{f}")
def test_split_is_disjoint_and_covering_in_index_order(fraction):
    train, held = split_heldout(IDS, fraction, seed=0)
    assert sorted(train + held) == list(range(len(IDS)))
    assert not set(train) & set(held)
    assert train == sorted(train) and held == sorted(held)


def test_fraction_zero_holds_nothing_out():
    train, held = split_heldout(IDS, 0.0, seed=4)
    assert held == [] and train == list(range(len(IDS)))


def test_empty_ids_split_to_nothing():
    assert split_heldout([], 0.5, seed=0) == ([], [])


def held_ids(ids: list[str], fraction: float, seed: int) -> set[str]:
    return {ids[i] for i in split_heldout(ids, fraction, seed)[1]}


def test_split_is_stable_under_reordering():
    shuffled = IDS[:]
    random.Random(0).shuffle(shuffled)
    assert held_ids(shuffled, 0.2, seed=1) == held_ids(IDS, 0.2, seed=1)
    assert held_ids(IDS[::-1], 0.2, seed=1) == held_ids(IDS, 0.2, seed=1)


def test_an_ids_side_never_changes_when_data_grow():
    small = held_ids(IDS[:500], 0.2, seed=1)
    grown = held_ids(IDS + [f"new-{i}" for i in range(3000)], 0.2, seed=1)
    assert grown & set(IDS[:500]) == small
    for sample_id in IDS[:50]:  # alone, each id lands on the same side as in the full list
        assert held_ids([sample_id], 0.2, seed=1) == ({sample_id} & small)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5], ids=lambda f: f"fraction-{f}")
def test_held_out_share_is_binomially_close_to_the_fraction(fraction):
    n = 10_000
    held = split_heldout([f"conv-{i}" for i in range(n)], fraction, seed=0)[1]
    sigma = math.sqrt(n * fraction * (1 - fraction))
    assert abs(len(held) - n * fraction) < 5 * sigma, (len(held), n * fraction, sigma)


def test_different_seeds_hold_out_different_samples():
    a, b = held_ids(IDS, 0.2, seed=0), held_ids(IDS, 0.2, seed=1)
    assert a != b
    # two independent 20 % draws overlap on about 4 % of the ids, nowhere near all of them
    assert len(a & b) < 0.5 * len(a)


def test_the_default_window_fills_batches_with_real_tokens():
    """A sorting window must hold many batches: with 64-sample windows each window's leftover batch halved the real
    tokens per step of the GPU recipe (mean 451 tokens a sample, 32k-token batches). Lengths drawn like its answers."""
    rng = random.Random(0)
    lengths = [min(2048, int(rng.lognormvariate(5.9, 0.6))) for _ in range(4000)]
    plan = plan_batches(list(range(len(lengths))), lengths, 32768, seed=0, epoch=0)
    real = sum(lengths)
    assert real / (len(plan) * 32768) > 0.8  # real tokens per batch, against the budget
    small = plan_batches(list(range(len(lengths))), lengths, 32768, seed=0, epoch=0, bucket=64)
    assert len(small) > 1.5 * len(plan)
