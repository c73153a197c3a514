"""LateVote: a decision all ranks take together (a checkpoint's clock) learned one call late, the same on every
rank; in one process, at once. Two gloo ranks meet through a file (no port)."""

from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from hstap.train.distributed import Dist, LateVote

VOTES = {0: [False, True, False, False, False, True, True],
         1: [False, False, False, True, True, False, False]}
CLEAR_AFTER = 4  # the call after which both ranks act on a yes and drop the vote in flight


def _rank(rank: int, rendezvous: str, out: str) -> None:
    tdist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    vote = LateVote(Dist(rank, 2, torch.device("cpu")))
    answers = []
    for i, yes in enumerate(VOTES[rank]):
        answers.append(vote(yes))
        if i == CLEAR_AFTER:
            vote.clear()
    torch.save(answers, Path(out) / f"rank{rank}.pt")
    tdist.destroy_process_group()


def test_every_rank_learns_any_ranks_yes_one_call_late(tmp_path):
    mp.spawn(_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    answers = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert answers[0] == answers[1]
    # call i answers call i-1's "any rank said yes"; call 5 answers nothing (call 4's vote was cleared)
    assert answers[0] == [False, False, True, False, True, False, True]


def test_one_process_decides_at_once():
    vote = LateVote(Dist(0, 1, torch.device("cpu")))
    assert [vote(v) for v in (True, False, True)] == [True, False, True]
