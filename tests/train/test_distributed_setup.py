"""Joining torchrun's process group: the collective timeout. Rank 0 alone evaluates the held-out set while the other
ranks wait in their next collective, so NCCL's default (10 minutes, then the run is aborted) is replaced by 30
minutes, or $HSTAP_DIST_TIMEOUT_S."""

from datetime import timedelta

import pytest
import torch

import hstap.train.distributed as distributed
from hstap.errors import HstapError


@pytest.fixture
def joined(monkeypatch):
    """setup() as rank 1 of 2, with the process group's constructor recording what it was given."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.tdist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    return calls


def test_a_collective_waits_thirty_minutes_or_what_the_environment_says(joined, monkeypatch):
    dist = distributed.setup("cpu")
    assert (dist.rank, dist.world_size, dist.device) == (1, 2, torch.device("cpu"))
    assert joined == [("gloo", {"timeout": timedelta(minutes=30)})]
    monkeypatch.setenv("HSTAP_DIST_TIMEOUT_S", "5400")
    distributed.setup("cpu")
    assert joined[-1] == ("gloo", {"timeout": timedelta(seconds=5400)})
    for bad in ("0", "ten"):
        monkeypatch.setenv("HSTAP_DIST_TIMEOUT_S", bad)
        with pytest.raises(HstapError, match=f"HSTAP_DIST_TIMEOUT_S='{bad}': expected a positive number of seconds"):
            distributed.setup("cpu")
