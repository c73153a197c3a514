"""Shipped drafters: unpacked once into the cache by content, refused by name in one line when unknown or damaged,
and the GPU recipe's drafter drafts the real target's MT-bench answers (greedy output unchanged, τ well above 1)."""

from __future__ import annotations

import shutil

import pytest

from hstap.drafter import shipped
from hstap.drafter.shipped import resolve_drafter, shipped_names
from hstap.errors import HstapError


@pytest.fixture(scope="module")
def cache(tmp_path_factory, target):
    """One model cache for the module: the 29 MB unpack (~2 s) happens once. The target is loaded first, from the
    usual cache (under this one it would be converted again)."""
    root = tmp_path_factory.mktemp("shipped") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSTAP_CACHE", str(root))
        yield root


def test_a_shipped_name_unpacks_once_into_the_cache(cache):
    assert "smollm2-recipe" in shipped_names()
    first = resolve_drafter("smollm2-recipe")
    assert first.parent == cache / "drafters" and first.name.startswith("smollm2-recipe-")
    assert {p.name for p in first.iterdir()} == {"checksum.json", "config.json", "model.safetensors",
                                                 "provenance.json"}
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_drafter("smollm2-recipe") == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if ".tmp" in p.name], "no temporary directory is left behind"


def test_the_shipped_weights_are_checked_by_their_checksum_even_in_an_older_cache(cache):
    """checksum.json ships beside the archive: the unpacked weights verify against it (a flipped byte in the cache
    is refused by every load), and a cache unpacked before it shipped gets it on the next resolve. The target the
    drafter was trained for is unchanged (its fingerprint, the SmolLM2 conversion's)."""
    from hstap.drafter.config import DrafterConfig
    from hstap.drafter.integrity import CHECKSUM, verify_checksum

    unpacked = resolve_drafter("smollm2-recipe")
    assert verify_checksum(unpacked)
    assert DrafterConfig.load(unpacked / "config.json").target_fingerprint == "bf47b30c88baf94b"
    (unpacked / CHECKSUM).unlink()  # as a cache unpacked before 2026-12 is
    assert resolve_drafter("smollm2-recipe") == unpacked and verify_checksum(unpacked)


def test_reference_names_the_recipe_drafter(cache):
    assert "reference" in shipped_names()
    assert resolve_drafter("reference") == resolve_drafter("smollm2-recipe")
    assert shipped.drafter_config_path("reference") == shipped.SHIPPED / "smollm2-recipe" / "config.json"


def test_a_directory_is_taken_as_it_is(tmp_path):
    assert resolve_drafter(tmp_path) == tmp_path


def test_an_unknown_name_lists_the_shipped_ones(cache):
    with pytest.raises(HstapError, match=r"--init-from no-such: no such directory, .*: reference, smollm2-recipe\)"):
        resolve_drafter("no-such", flag="--init-from")


def test_a_damaged_archive_is_one_line_and_leaves_nothing(cache, tmp_path, monkeypatch):
    before = set((cache / "drafters").iterdir()) if (cache / "drafters").exists() else set()
    src = tmp_path / "ship" / "broken"
    src.mkdir(parents=True)
    whole = shipped.SHIPPED / "smollm2-recipe" / shipped.PACKED
    (src / shipped.PACKED).write_bytes(whole.read_bytes()[: 1 << 20])  # cut off after 1 MiB
    shutil.copy(whole.parent / "config.json", src)
    monkeypatch.setattr(shipped, "SHIPPED", src.parent)
    with pytest.raises(HstapError, match=r"broken/model.safetensors.xz: not a whole xz archive"):
        resolve_drafter("broken")
    assert set((cache / "drafters").iterdir()) == before


def test_the_recipe_drafter_drafts_the_real_targets_answers(target, cache):
    """fp32 on the CPU: chain-3 decoding of an MT-bench first turn (question 101, reasoning) equals greedy decoding
    token for token, and the drafter's acceptance is well above an untrained one's (τ 1.0; 2.03 on all 80 questions
    × 256 tokens on an H200; 1.68 here, 1.31–2.24 on six questions × 48 tokens)."""
    from hstap.data import load_mtbench, render_prompt
    from hstap.drafter.load import load_drafter
    from hstap.evaluate.results import Prompt
    from hstap.evaluate.run import evaluate_shapes
    from hstap.runtime.shapes import DraftShape

    drafter = load_drafter("smollm2-recipe", target)
    prompts = [Prompt(q.id, render_prompt(q.messages[:1], target.tokenizer)) for q in load_mtbench()[20:21]]
    vanilla, (chain,) = evaluate_shapes(target.model, drafter, prompts, [DraftShape.parse("chain:3")], 48,
                                        set(target.stop_ids), warmup=0, progress=False)
    assert [g.tokens for g in chain.generations] == [g.tokens for g in vanilla.generations]
    assert prompts[0].id == "mt-bench-101" and chain.tau >= 1.4, chain.tau
