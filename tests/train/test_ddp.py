"""DDP on the CPU: two gloo processes under torchrun end a step with identical weights."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from hstap.drafter import DrafterConfig, Eagle3Drafter

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_gloo_ranks_hold_identical_weights_after_a_step(train_store, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           str(WORKER), str(train_store), str(tmp_path / "run"), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between ranks"
    # the step moved the weights away from the seeded initialisation the trainer starts from
    saved = Eagle3Drafter.from_pretrained(tmp_path / "run")  # written by rank 0 after the step
    assert torch.equal(saved.fc.weight, rank0["fc.weight"])
    torch.manual_seed(0)
    untrained = Eagle3Drafter(DrafterConfig.load(tmp_path / "run" / "config.json"))
    assert not torch.equal(untrained.fc.weight, rank0["fc.weight"])
