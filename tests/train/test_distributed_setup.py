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


def test_one_process_on_cuda_names_its_device_as_its_tensors_do(monkeypatch):
    """`--device cuda` in one process is cuda:0, the device its tensors report: `torch.device("cuda")` compares
    unequal to it, and the trainer's "already there" checks (the hidden teacher's head) made a second copy."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.setup("cuda").device == torch.device("cuda:0")
    assert distributed.setup("cuda:1").device == torch.device("cuda:1")
    assert distributed.setup("cpu").device == torch.device("cpu")
