"""`hstap train --init-from DRAFTER --draft-vocab N --draft-intermediate W` on real SmolLM2 captures: a larger N
grows the init drafter's draft vocabulary (its tokens' logits unchanged, the new tokens' head rows a fresh
drafter's), a larger W widens its MLP (its logits unchanged, the new units trained from the first step), unset sizes
keep the init's (also on a GPU, whose default vocabulary would be larger), smaller ones are refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hstap.train.build as build_module
from hstap.drafter import Eagle3Drafter, draft_to_target_ids, target_to_draft_ids
from hstap.errors import HstapError
from hstap.train.config import TrainConfig
from hstap.train.data import load_batch
from hstap.train.run import run_train

# batches of 256 tokens (were 768): the tests check what the grown drafter starts from, not what a step learns
FAST = dict(ttt_steps=3, heldout=0.1, seed=0, calib_prompts=0, batch_tokens=256)
SMALL, LARGE = 1024, 3000  # the init drafter's draft vocabulary, the grown one's


@pytest.fixture(scope="module")
def small_run(small_store, tmp_path_factory) -> Path:
    """A drafter trained two steps over a 1,024-token draft vocabulary: the one the tests continue."""
    out = tmp_path_factory.mktemp("init") / "small"
    run_train(TrainConfig(store=small_store, out=out, max_steps=2, draft_vocab=SMALL, **FAST), progress=False)
    return out


def _logits(drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One causal draft step in fp32, eval mode: (B, S, Vd)."""
    def attend(q, k, v):  # q (B, nh, S, hd), k/v (B, nkv, S, hd)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    positions = torch.arange(ids.shape[1]).expand_as(ids)  # (B, S)
    with torch.no_grad():
        return drafter.eval().step(ids, drafter.project(aux), positions, attend)[1]


def test_a_larger_draft_vocab_grows_the_init_drafter_keeping_its_rows(small_store, small_run, tmp_path, monkeypatch,
                                                                      capsys):
    """The drafter the trainer builds (caught before its first step): every weight but the head is the init's, the
    kept tokens' rows moved by target id so their logits on real captured states equal the init's exactly, the new
    rows those the fresh path (no --init-from, same size and seed) starts from; the run records the size it used."""
    built = {}

    def build_and_keep(cfg, target, source, train_idx, layer_ids):
        built["grown"] = copy.deepcopy(real_build(cfg, target, source, train_idx, layer_ids))
        fresh_cfg = cfg.model_copy(update={"init_from": None})
        built["fresh"] = real_build(fresh_cfg, target, source, train_idx, layer_ids)
        built["batch"] = load_batch(source, train_idx[:2], layer_ids, torch.device("cpu"))
        return copy.deepcopy(built["grown"])

    real_build = build_module.build_drafter
    monkeypatch.setattr(build_module, "build_drafter", build_and_keep)
    out = tmp_path / "grown"
    result = run_train(TrainConfig(store=small_store, out=out, init_from=small_run, draft_vocab=LARGE, max_steps=1,
                                   **FAST), progress=False)
    assert ("draft vocabulary grown from 1,024 to 3,000 tokens: 1,976 new rows start from a fresh head's "
            "initialisation") in capsys.readouterr().out

    init, grown, fresh = Eagle3Drafter.from_pretrained(small_run), built["grown"], built["fresh"]
    vocab = init.config.vocab_size
    old_targets, new_targets = draft_to_target_ids(init.d2t), draft_to_target_ids(grown.d2t)
    assert grown.config.draft_vocab_size == LARGE and grown.lm_head.weight.shape == (LARGE, init.config.hidden_size)
    assert bool((new_targets.diff() > 0).all()) and torch.equal(grown.t2d.nonzero().flatten(), new_targets)
    assert bool(grown.t2d[old_targets].all())  # every old token kept
    moved = target_to_draft_ids(grown.d2t, vocab)[old_targets]  # (SMALL,) the new draft id of each old row
    assert torch.equal(new_targets[moved], old_targets)
    for name, value in init.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(grown.state_dict()[name], value), name
    assert torch.equal(grown.lm_head.weight[moved], init.lm_head.weight)

    batch = built["batch"]
    before, after = _logits(init, batch.aux, batch.input_ids), _logits(grown, batch.aux, batch.input_ids)
    assert torch.equal(after[..., moved], before)  # (B, S, SMALL): the kept tokens, exactly
    new_rows = torch.ones(LARGE, dtype=torch.bool)
    new_rows[moved] = False
    assert int(new_rows.sum()) == LARGE - SMALL
    assert torch.equal(grown.lm_head.weight[new_rows], fresh.lm_head.weight[new_rows])
    assert not torch.equal(grown.lm_head.weight[moved], fresh.lm_head.weight[moved])

    assert json.loads((out / "train_config.json").read_text())["draft_vocab"] == LARGE
    assert Eagle3Drafter.from_pretrained(out).config.draft_vocab_size == LARGE
    assert torch.equal(result.drafter.d2t, grown.d2t)


def test_a_smaller_draft_vocab_is_refused_and_an_unset_one_keeps_the_init_drafters(small_store, small_run, tmp_path,
                                                                                   monkeypatch, capsys):
    """Refused before anything loads or is written; unset on a GPU (default 32,000) it is the init drafter's, also
    for the shipped drafter, whose size `--plan` reads without unpacking its weights."""
    import hstap.drafter.shipped as shipped
    from hstap.cli import main

    with pytest.raises(HstapError, match=r"--draft-vocab 512 is smaller than the 1,024-token draft vocabulary of "
                                         r"--init-from .*small: shrinking would throw trained weights away") as err:
        run_train(TrainConfig(store=small_store, out=tmp_path / "o", init_from=small_run, draft_vocab=512, **FAST),
                  progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()

    monkeypatch.setattr(shipped, "unpack", lambda src: pytest.fail(f"--plan unpacked {src}"))
    gpu = dict(store=small_store, out=tmp_path / "p", device="cuda")
    assert TrainConfig(init_from=small_run, **gpu).resolved()["draft_vocab"] == SMALL
    assert TrainConfig(init_from=small_run, draft_vocab=SMALL, **gpu).resolved()["draft_vocab"] == SMALL
    assert TrainConfig(init_from="smollm2-recipe", **gpu).resolved()["draft_vocab"] == 16384
    assert TrainConfig(init_from="smollm2-recipe", **gpu).resolved()["draft_intermediate"] == 1536
    assert TrainConfig(init_from="smollm2-recipe", draft_vocab=32000, **gpu).resolved()["draft_vocab"] == 32000
    assert TrainConfig(**gpu).resolved()["draft_vocab"] == 32000  # no --init-from: the GPU default
    assert main(["train", "--store", str(small_store), "--out", str(tmp_path / "p"), "--device", "cuda",
                 "--init-from", "smollm2-recipe", "--plan"]) == 0
    assert "draft_vocab: 16384" in capsys.readouterr().out


def test_resuming_with_another_draft_vocab_is_refused_in_one_line(small_store, small_run):
    """A run resumed by a command that would build another head size (a grown run resumed without its
    --draft-vocab) is refused before anything loads, instead of failing inside load_state_dict."""
    with pytest.raises(HstapError, match=r"--resume: the run in .*small trains a 1,024-token draft vocabulary, this "
                                         r"command builds 3,000: pass --draft-vocab 1024") as err:
        run_train(TrainConfig(store=small_store, out=small_run, resume=True, draft_vocab=LARGE, max_steps=3, **FAST),
                  progress=False)
    assert "\n" not in str(err.value)


WIDE = 2 * 1536  # the grown MLP's units (SmolLM2's intermediate_size is 1,536)


def test_a_wider_mlp_grows_the_init_drafter_computing_what_it_did(small_store, small_run, tmp_path, monkeypatch,
                                                                  capsys):
    """The grown drafter (caught before its first step) gives the init's logits on real captured states, its kept
    units bit-exact and its new units' down columns zero; one step later those columns have moved (they get a
    gradient); both config files record the width, and a resume without --draft-intermediate is refused."""
    built = {}

    def build_and_keep(cfg, target, source, train_idx, layer_ids):
        built["grown"] = copy.deepcopy(real_build(cfg, target, source, train_idx, layer_ids))
        built["batch"] = load_batch(source, train_idx[:2], layer_ids, torch.device("cpu"))
        return copy.deepcopy(built["grown"])

    real_build = build_module.build_drafter
    monkeypatch.setattr(build_module, "build_drafter", build_and_keep)
    out = tmp_path / "wide"
    result = run_train(TrainConfig(store=small_store, out=out, init_from=small_run, draft_intermediate=WIDE,
                                   max_steps=1, **FAST), progress=False)
    assert "MLP grown from 1,536 to 3,072 units" in capsys.readouterr().out
    init, grown = Eagle3Drafter.from_pretrained(small_run), built["grown"]
    mlp, old = grown.midlayer.mlp, init.midlayer.mlp
    assert grown.config.intermediate_size == WIDE and mlp.down_proj.weight.shape == (576, WIDE)
    assert torch.equal(mlp.gate_proj.weight[:1536], old.gate_proj.weight)
    assert torch.equal(mlp.up_proj.weight[:1536], old.up_proj.weight)
    assert torch.equal(mlp.down_proj.weight[:, :1536], old.down_proj.weight)
    assert not bool(mlp.down_proj.weight[:, 1536:].any()) and bool(mlp.gate_proj.weight[1536:].any())
    for name, value in init.state_dict().items():
        if ".mlp." not in name:
            assert torch.equal(grown.state_dict()[name], value), name
    batch = built["batch"]
    torch.testing.assert_close(_logits(grown, batch.aux, batch.input_ids), _logits(init, batch.aux, batch.input_ids))

    trained = result.drafter.midlayer.mlp.down_proj.weight.detach()
    assert float(trained[:, 1536:].abs().max()) > 0  # the new units learn from the first step
    assert json.loads((out / "train_config.json").read_text())["draft_intermediate"] == WIDE
    assert Eagle3Drafter.from_pretrained(out).config.intermediate_size == WIDE
    with pytest.raises(HstapError, match=r"--resume: the run in .*wide trains an MLP of 3,072 units, this command "
                                         r"builds 1,536: pass --draft-intermediate 3072") as err:
        run_train(TrainConfig(store=small_store, out=out, resume=True, max_steps=2, draft_vocab=SMALL, **FAST),
                  progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(HstapError, match=r"--draft-intermediate 1000 is smaller than the 3,072 units of the MLP of "
                                         r"--init-from .*wide: shrinking would throw trained weights away"):
        TrainConfig(store=small_store, out=tmp_path / "o", init_from=out, draft_intermediate=1000).resolved()
