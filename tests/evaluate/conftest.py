"""Shared by the evaluation tests: an untrained SmolLM2 drafter and real prompts."""

from __future__ import annotations

import itertools

import pytest
import torch

from hstap.data import iter_sharegpt, load_mtbench, render_prompt
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.evaluate.results import Prompt


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[Prompt]:
    """8 MT-bench first turns and 4 short ShareGPT first turns."""
    out = [Prompt(q.id, render_prompt(q.messages[:1], tokenizer)) for q in load_mtbench()[:8]]
    short = (Prompt(c.id, ids) for c in iter_sharegpt()
             if len(ids := render_prompt(c.messages[:1], tokenizer)) <= 200)
    return out + list(itertools.islice(short, 4))


@pytest.fixture(scope="session")
def drafter(target, prompts) -> Eagle3Drafter:
    """Untrained drafter; its 2048-token draft vocabulary holds the prompts' tokens."""
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target.model.config, [1, 14, 26], 2048, target.model_id, target.fingerprint)
    model = Eagle3Drafter(cfg)
    counts = torch.zeros(target.model.config.vocab_size, dtype=torch.long)
    for p in prompts:
        counts += torch.bincount(torch.tensor(p.ids), minlength=counts.numel())
    model.init_from_target(target.model, *build_draft_vocab(counts, 2048))
    return model.eval()


@pytest.fixture(scope="session")
def stop_ids(target) -> set[int]:
    return set(target.stop_ids)
