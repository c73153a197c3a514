"""Shared by the runtime tests: one intra-op thread, real MT-bench prompts, an untrained SmolLM2 drafter, and
greedy references from transformers' own DynamicCache path (independent of the runtime)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hstap.data import load_mtbench, render_prompt
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from tests.conftest import shared_json

MAX_NEW = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core machine: one intra-op thread runs far faster under load
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Four MT-bench first turns of different lengths (left padding is exercised)."""
    out = [render_prompt(q.messages[:1], tokenizer) for q in load_mtbench()[:4]]
    assert len({len(p) for p in out}) == len(out)
    return out


@pytest.fixture(scope="session")
def drafter(target, prompts) -> Eagle3Drafter:
    """Untrained drafter; its 2048-token draft vocabulary holds the prompts' tokens."""
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target.model.config, [1, 14, 26], 2048, target.model_id, target.fingerprint)
    model = Eagle3Drafter(cfg)
    counts = torch.zeros(target.model.config.vocab_size, dtype=torch.long)
    for p in prompts:
        counts += torch.bincount(torch.tensor(p), minlength=counts.numel())
    model.init_from_target(target.model, *build_draft_vocab(counts, 2048))
    return model.eval()


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding on transformers' DynamicCache, one token per forward, the stop token included."""
    from transformers import DynamicCache

    device = next(model.parameters()).device  # the model's own device: the CUDA tests pass a CUDA copy
    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt], device=device), []
    while len(out) < max_new and not (out and out[-1] in stop_ids):
        out.append(int(model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
        ids = torch.tensor([out[-1:]], device=device)
    return out


@pytest.fixture(scope="session")
def references(target, prompts, tmp_path_factory) -> list[list[int]]:
    """The prompts' greedy answers, computed once per run: test_spec and test_fused_drafter usually run on
    different xdist workers, and each worker decoding them cost ~5 s of a core."""
    return shared_json(tmp_path_factory, "runtime_references",
                       lambda: [greedy_reference(target.model, p, MAX_NEW, set(target.stop_ids)) for p in prompts])


def assert_greedy_identity(runtime, prompt: list[int], reference: list[int], tokens: list[int], what: str) -> None:
    """`tokens` is the greedy `reference` answer, or leaves it only where rounding explains it: the first differing
    token's two candidates are the target's top two, within the dtype's rounding of each other
    (hstap.evaluate.divergence). A wider margin is a bug in `what`, and fails."""
    from hstap.evaluate.divergence import first_divergence

    div = first_divergence(runtime, "", prompt, reference, tokens)
    assert div is None or div.within_rounding, (
        f"{what} left the reference at token {div.position}: {div.shape_token} for {div.vanilla_token}, a margin of "
        f"{div.margin_ulps:.3g} rounding steps{'' if div.top_two else ' (not the top two)'}, not rounding")


def fake_slot(start: list[int], write_at: list[int], length: int = 64) -> SimpleNamespace:
    """What the drafting functions read of a `Slot`, for drafter-only tests."""
    start_t, write_t = torch.tensor(start), torch.tensor(write_at)
    return SimpleNamespace(start=start_t, write_at=write_t, length=length, batch=len(start),
                           positions=write_t - start_t)
