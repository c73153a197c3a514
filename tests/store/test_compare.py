"""`hstap compare`: identical stores match, a perturbed layer, a layer-id shift, missing samples and different
tokens are each named in the verdict."""

from __future__ import annotations

import json

import pytest
import torch

from hstap.cli import main
from hstap.config import TeacherSpec
from hstap.store import StoreWriter
from hstap.store.compare import compare_stores
from tests.store.conftest import LAYERS, make_sample, write_samples


def _write(path, meta, ids, change=None):
    with StoreWriter(path, meta, shard_bytes=4096) as w:
        for i in ids:
            sample = make_sample(i)
            if change:
                change(i, sample)
            w.add(f"s{i}", sample)


def test_identical_stores_match(tmp_path, meta, capsys):
    write_samples(tmp_path / "a", meta, range(6))
    write_samples(tmp_path / "b", meta, range(6))
    c = compare_stores(tmp_path / "a", tmp_path / "b")
    assert c.ok and c.common == 6 and not c.uncompared
    assert set(c.tensors) == {f"hidden.{k}" for k in LAYERS} | {"teacher.topk_logprobs", "teacher.topk_ids"}
    assert all(s.max_abs == 0 and s.min_cos > 0.999999 for s in c.tensors.values())
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "verdict: MATCH" in out and "hidden.14" in out


def test_one_perturbed_layer_of_one_sample_is_named(tmp_path, meta, capsys):
    write_samples(tmp_path / "a", meta, range(5))

    def noise(i, sample):
        if i == 3:
            sample["hidden.14"] = (sample["hidden.14"].float() + 0.5 * torch.randn_like(sample["hidden.14"].float())
                                   ).to(torch.bfloat16)

    _write(tmp_path / "b", meta, range(5), noise)
    c = compare_stores(tmp_path / "a", tmp_path / "b")
    assert not c.ok
    assert c.tensors["hidden.14"].worst_sample == "s3" and c.tensors["hidden.14"].max_rel > 0.1
    assert c.tensors["hidden.1"].max_abs == 0
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "hidden.14" in report["verdict"] and "s3" in report["verdict"]


def test_off_by_one_layer_convention_fails_every_layer(tmp_path, meta):
    write_samples(tmp_path / "a", meta, range(4))

    def shifted(i, sample):  # what a +1 convention mix-up looks like: every layer holds its neighbour's values
        layers = [sample[f"hidden.{k}"] for k in LAYERS]
        for k, values in zip(LAYERS, layers[1:] + layers[:1]):
            sample[f"hidden.{k}"] = values

    _write(tmp_path / "b", meta, range(4), shifted)
    c = compare_stores(tmp_path / "a", tmp_path / "b")
    assert not c.ok and all(c.tensors[f"hidden.{k}"].min_cos < 0.9 for k in LAYERS)


def test_missing_samples_and_different_tokens_are_reported(tmp_path, meta):
    write_samples(tmp_path / "a", meta, range(5))

    def retokenized(i, sample):
        if i == 1:
            sample["input_ids"] = sample["input_ids"].flip(0)

    _write(tmp_path / "b", meta, range(1, 7), retokenized)
    c = compare_stores(tmp_path / "a", tmp_path / "b")
    assert c.only_a == ["s0"] and c.only_b == ["s5", "s6"] and c.token_mismatch == ["s1"]
    assert "1 samples only in A, 2 only in B" in c.verdict() and "'s1'" in c.verdict()


def test_extra_samples_with_every_common_one_matching_is_not_a_mismatch(tmp_path, meta, capsys):
    write_samples(tmp_path / "a", meta, range(5))
    write_samples(tmp_path / "b", meta, range(8))
    c = compare_stores(tmp_path / "a", tmp_path / "b")
    assert c.common_match and not c.ok and c.status == "common-match"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("verdict: COMMON MATCH — all 5 common samples match")
    assert verdict.endswith("0 samples only in A, 3 only in B, not compared") and "MISMATCH" not in verdict
    assert main(["compare", str(tmp_path / "b"), str(tmp_path / "a"), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "common-match" and report["ok"] is False and len(report["only_a"]) == 3


def test_not_a_store_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert "not an hstap store" in capsys.readouterr().err


def _truth(i: int) -> dict[str, torch.Tensor]:
    """Sample `s{i}` as an fp32 reference holds it: the hidden states before any bf16 rounding."""
    sample = make_sample(i)
    g = torch.Generator().manual_seed(1000 + i)
    for k in LAYERS:
        sample[f"hidden.{k}"] = torch.randn(len(sample["input_ids"]), 16, generator=g)
    return sample


def _rounded_capture(i: int, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """What a bf16 computation of `_truth(i)` stores: the truth off by rounding that grows with depth (`scale`
    relative at the last layer), then rounded to bf16; `seed` picks the computation's own summation order."""
    sample = _truth(i)
    g = torch.Generator().manual_seed(seed * 7919 + i)
    for k in LAYERS:
        x = sample[f"hidden.{k}"]
        off = torch.randn(x.shape, generator=g) * x.norm() / x.numel() ** 0.5 * scale * k / LAYERS[-1]
        sample[f"hidden.{k}"] = (x + off).to(torch.bfloat16)
    return sample


def _store(path, meta, ids, make, **meta_changes):
    with StoreWriter(path, meta.model_copy(update=meta_changes), shard_bytes=4096) as w:
        for i in ids:
            w.add(f"s{i}", make(i))


def test_reference_judges_two_bf16_captures_by_their_distance_from_an_fp32_one(tmp_path, meta, capsys):
    """Two right bf16 captures of a deep model differ by more than bf16's step (1.5 % each from the truth at the
    last layer: ~2 % apart), so A against B is a MISMATCH; against an fp32 capture each is as close as the other:
    MATCH. A capture four times further from the truth fails, and the verdict names it and the layer."""
    _store(tmp_path / "ref", meta, range(6), _truth, hidden_dtype="fp32", extra={"target_dtype": "fp32"})
    for name, seed, scale in (("a", 1, 0.015), ("b", 2, 0.015), ("wrong", 3, 0.06)):
        _store(tmp_path / name, meta, range(6), lambda i: _rounded_capture(i, seed, scale),
               extra={"target_dtype": "bf16"})
    a, b, ref, wrong = (str(tmp_path / n) for n in ("a", "b", "ref", "wrong"))
    assert compare_stores(a, b).status == "mismatch"
    c = compare_stores(a, b, reference=ref)
    assert c.ok and c.common == 6, c.verdict()
    deep = c.vs_reference["A"]["hidden.26"]
    assert deep.rtol == 2 * c.vs_reference["B"]["hidden.26"].max_rel and 0.01 < deep.max_rel < deep.rtol
    assert c.tensors["hidden.26"].max_rel > c.tensors["hidden.26"].rtol  # A–B shown, not judged
    assert main(["compare", a, b, "--reference", ref]) == 0
    out = capsys.readouterr().out
    assert "A against the reference" in out and out.strip().endswith("identical tokens")

    c = compare_stores(wrong, b, reference=ref)
    assert not c.ok and "hidden.26 (A vs R)" in c.verdict() and "(B vs R)" not in c.verdict()
    assert "hidden.1 (A vs R)" not in c.verdict()  # the shallow layer is within bf16's own step
    assert main(["compare", wrong, b, "--reference", ref, "--within", "5"]) == 0  # the user's own, looser bound
    capsys.readouterr()


def test_reference_lacking_samples_or_no_finer_is_said(tmp_path, meta, capsys):
    _store(tmp_path / "ref", meta, range(4), _truth, hidden_dtype="fp32", extra={"target_dtype": "fp32"})
    for name in ("a", "b"):
        _store(tmp_path / name, meta, range(6), lambda i: _rounded_capture(i, 1, 0.001),
               extra={"target_dtype": "bf16"})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    c = compare_stores(a, b, reference=tmp_path / "ref")
    assert c.status == "common-match" and c.common == 4 and c.not_in_reference == ["s4", "s5"]
    assert "2 of the common ones not in the reference" in c.verdict()
    assert main(["compare", a, b, "--reference", str(tmp_path / "ref")]) == 3
    capsys.readouterr()
    assert main(["compare", a, b, "--reference", b]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hstap: error: --reference {b}: computed in bf16, no finer than {a}'s bf16; capture the "
                   "reference with --target-dtype fp32")


def _sample_of(i: int, layers: list[int], hidden: int) -> dict[str, torch.Tensor]:
    """`make_sample(i)` with other layers or another hidden size (what a capture of other settings holds)."""
    sample = {k: v for k, v in make_sample(i).items() if not k.startswith("hidden.")}
    g = torch.Generator().manual_seed(i)
    for k in layers:
        sample[f"hidden.{k}"] = torch.randn(len(sample["input_ids"]), hidden, generator=g).to(torch.bfloat16)
    return sample


@pytest.mark.parametrize("change, says", [
    ({"layer_ids": [2, 10, 20]}, "layer ids [1, 14, 26] vs [2, 10, 20]"),
    ({"hidden_size": 24}, "hidden size 16 vs 24"),
    ({"model_fingerprint": "f00d", "model_id": "other/model"}, "model test/tiny (fingerprint abc123) vs "
                                                               "other/model (fingerprint f00d)"),
    ({"teacher": "topk:6"}, "teacher topk:4 vs topk:6"),
])
def test_stores_that_hold_different_things_are_different_stores_in_one_line(tmp_path, meta, capsys, change, says):
    """Issue 43: other layers compared only the teacher and said MATCH; another model's hidden size ended in a
    RuntimeError. Now the meta are checked first: one line naming what differs, exit 2, no sample read. What may
    differ — the storage dtype, `extra` (an engine's route and its own layer ids) — still compares."""
    write_samples(tmp_path / "a", meta, range(3))
    other = meta.model_copy(update={k: (TeacherSpec.parse(v) if k == "teacher" else v) for k, v in change.items()})
    k = other.teacher.k

    def make(i):
        sample = _sample_of(i, other.layer_ids, other.hidden_size)
        sample["teacher.topk_ids"] = sample["teacher.topk_ids"][:, :1].repeat(1, k)
        sample["teacher.topk_logprobs"] = sample["teacher.topk_logprobs"][:, :1].repeat(1, k)
        return sample

    _store(tmp_path / "b", other, range(3), make)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hstap: error: DIFFERENT STORES: {tmp_path / 'a'} and "
                                                   f"{tmp_path / 'b'} cannot be compared: {says}"), err
    assert "Traceback" not in err

    engine = meta.model_copy(update={"extra": {"engine": "vllm", "route": "extract", "vllm_aux_ids": [2, 15, 27]}})
    _store(tmp_path / "engine", engine, range(3), lambda i: {n: t.float() if n.startswith("hidden.") else t
                                                             for n, t in make_sample(i).items()}, hidden_dtype="fp32")
    assert compare_stores(tmp_path / "a", tmp_path / "engine").ok


def test_any_model_compares_the_same_weights_under_another_config(tmp_path, meta, capsys):
    """Another fingerprint is DIFFERENT STORES unless --any-model says the weights are the same (an engine's
    wrapper of the checkpoint has its own config.json); other layers stay different either way."""
    write_samples(tmp_path / "a", meta, range(3))
    write_samples(tmp_path / "b", meta.model_copy(update={"model_fingerprint": "f00d"}), range(3))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["compare", a, b]) == 2 and "--any-model" in capsys.readouterr().err
    assert main(["compare", a, b, "--any-model"]) == 0 and "verdict: MATCH" in capsys.readouterr().out
    _store(tmp_path / "c", meta.model_copy(update={"model_fingerprint": "f00d", "layer_ids": [2, 10, 20]}), range(3),
           lambda i: _sample_of(i, [2, 10, 20], meta.hidden_size))
    assert main(["compare", a, str(tmp_path / "c"), "--any-model"]) == 2
    assert "layer ids" in capsys.readouterr().err


def test_top_k_ids_are_compared_and_only_ties_may_swap(tmp_path, meta):
    """A top-k teacher's ids are a tensor both stores hold: ids shifted by one (a vocabulary offset) with equal
    log-probs used to MATCH, since only the log-probs were compared. Two ids whose log-probs tie may come in either
    order (rounding), any other difference is a MISMATCH naming teacher.topk_ids."""
    def tied(i):
        sample = make_sample(i)
        sample["teacher.topk_logprobs"][:, 1] = sample["teacher.topk_logprobs"][:, 0]  # ranks 0 and 1 tie
        return sample

    def swapped(i):
        sample = tied(i)
        sample["teacher.topk_ids"][:, [0, 1]] = sample["teacher.topk_ids"][:, [1, 0]]
        return sample

    def shifted(i):
        sample = tied(i)
        sample["teacher.topk_ids"] = sample["teacher.topk_ids"] + 1
        return sample

    for name, make in (("a", tied), ("swapped", swapped), ("shifted", shifted)):
        _store(tmp_path / name, meta, range(4), make)
    assert compare_stores(tmp_path / "a", tmp_path / "swapped").ok
    c = compare_stores(tmp_path / "a", tmp_path / "shifted")
    assert c.status == "mismatch" and c.tensors["teacher.topk_ids"].max_rel > 0.5  # all but the lowest kept ids
    assert "% of the top-k ids differ where the log-probs are not tied" in c.verdict()
    assert "teacher.topk_ids" in c.verdict()
    assert c.tensors["teacher.topk_logprobs"].max_abs == 0
