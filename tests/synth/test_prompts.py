"""`hstap prompts` end to end on real data and the real SmolLM2: a tiny mixed set, provenance counts that add up,
resume after a cut line, growth, the output read back as synth's input, one-line errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from hstap.cli import main
from hstap.data import SkipReport, open_source
from hstap.data.appender import JsonlAppender
from hstap.data.categories import CATEGORIES
from hstap.data.config import PromptsConfig
from hstap.errors import HstapError
from hstap.synth import prompts as prompts_module
from hstap.synth.magpie import Candidate
from hstap.synth.prompts import build_prompts

# Magpie last would make a cut line cost a model run; code last makes the resume test cheap.
SOURCES = ["magpie:1", "sharegpt:3", "code:3"]
FLAGS = ["--code-package", "json", "--code-package", "textwrap", "--batch-size", "8", "--max-new-tokens", "24"]


def _cfg(out, total: int = 7, **extra) -> PromptsConfig:
    return PromptsConfig(out=out, total=total, sources=SOURCES, code_packages=["json", "textwrap"], batch_size=8,
                         max_new_tokens=24, **extra)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    result = build_prompts(_cfg(out), target=target, progress=False)
    return out, result, out.read_bytes()


def test_mixed_set_matches_the_quotas(built):
    out, result, _ = built
    records = _records(out)
    assert result.quotas == {"magpie": 1, "sharegpt": 3, "code": 3}
    assert [r["source"] for r in records] == ["magpie"] + ["sharegpt"] * 3 + ["code"] * 3
    assert len({r["id"] for r in records}) == 7
    for r in records:
        assert set(r) <= {"id", "messages", "source", "category", "meta"} and r["id"].startswith(r["source"] + "-")
        assert r["messages"][0]["role"] == "user" and isinstance(r["category"], str)
    assert records[0]["category"] in {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                      "humanities"}
    assert {r["category"] for r in records[1:4]} <= {"conversation", "continuation"}


def test_provenance_counts_add_up(built):
    out, result, _ = built
    doc = json.loads((out.parent / "p.jsonl.provenance.json").read_text())
    assert doc["total"] == 7 and doc["weights"] == {"magpie": 1.0, "sharegpt": 3.0, "code": 3.0}
    assert doc["settings"]["seed"] == 0 and doc["settings"]["filters"]["min_chars"] == 16
    assert doc["model"]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and doc["model"]["fingerprint"]
    for name, tally in doc["sources"].items():
        assert tally["requested"] == tally["produced"] == tally["kept"], name
        assert tally["examined"] == tally["kept"] + sum(tally["dropped"].values()), name
        assert sum(tally["categories"].values()) == tally["produced"], name
    magpie = doc["sources"]["magpie"]
    assert magpie["next_attempt"] == magpie["examined"] and magpie["examined"] % 8 == 0
    sharegpt = doc["sources"]["sharegpt"]
    assert sharegpt["source_changes"]["recovered_continuation"] == 6099 and "empty_turn" in sharegpt["source_skips"]
    assert doc["sources"]["code"]["source_skips"]["private"] > 0
    assert "produced 1 (examined" in result.summary() and doc["runs"][0]["written"] == result.written


def test_output_is_synth_input(built):
    out, _, _ = built
    report = SkipReport()
    convs = list(open_source(f"jsonl:{out}", report=report))
    assert len(convs) == 7 and report.counts == {}
    assert {c.meta["source"] for c in convs} == {"magpie", "sharegpt", "code"}


def test_resume_after_a_cut_line_restores_the_same_file(built, target):
    out, _, whole = built
    copy = out.parent / "cut.jsonl"
    cut = whole[:-25]  # a kill in the middle of the last (code) line
    copy.write_bytes(cut)
    (out.parent / "cut.jsonl.provenance.json").write_text((out.parent / "p.jsonl.provenance.json").read_text())
    result = build_prompts(_cfg(copy), target=target, progress=False)
    assert result.partial_bytes_removed == len(cut) - len(cut[:cut.rindex(b"\n") + 1])
    assert result.written == {"code": 1} and result.resumed == 6
    assert copy.read_bytes() == whole, "the replayed source writes the very record that was cut"
    assert "removed a cut-off last line" in result.summary()


def test_cli_grows_the_set_and_refuses_other_settings(built, tmp_path, capsys):
    out, _, whole = built
    grow = tmp_path / "g.jsonl"
    grow.write_bytes(whole)
    (tmp_path / "g.jsonl.provenance.json").write_text((out.parent / "p.jsonl.provenance.json").read_text())
    argv = ["prompts", "--out", str(grow), "--source", "sharegpt:1", "--source", "code:1", *FLAGS]
    assert main([*argv, "--total", "10"]) == 0
    records = _records(grow)
    assert [json.dumps(r) for r in records[:7]] == [json.dumps(r) for r in _records(out)], "appended only"
    assert [r["source"] for r in records[7:]] == ["sharegpt"] * 2 + ["code"] * 2
    assert "written now, 7 already there" in capsys.readouterr().out
    assert main([*argv, "--total", "10", "--seed", "1"]) == 2
    assert "built with seed=0" in capsys.readouterr().err


def test_plan_shows_the_quotas(tmp_path, capsys):
    assert main(["prompts", "--out", str(tmp_path / "x.jsonl"), "--total", "10", "--source", "magpie:2",
                 "--source", "code", "--plan"]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().endswith("# quotas of --total 10: magpie 7, code 3")
    assert PromptsConfig(**yaml.safe_load(text)["prompts"]).quotas() == {"magpie": 7, "code": 3}


@pytest.mark.parametrize("args,message", [
    (["--source", "alpaca:1"], "unknown source 'alpaca' in 'alpaca:1': expected one of sharegpt, magpie, code"),
    (["--source", "code:0"], "weight of 'code' must be a positive number, got '0'"),
    (["--source", "code", "--source", "code:2"], "source 'code' given twice"),
    (["--set", "prompts.filters={min_char: 3}"], "prompts.filters.min_char: unknown field"),
])
def test_bad_settings_are_one_line_errors(tmp_path, capsys, args, message):
    assert main(["prompts", "--out", str(tmp_path / "x.jsonl"), "--total", "3", *args, "--plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_file_from_elsewhere_is_refused(tmp_path):
    out = tmp_path / "other.jsonl"
    out.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(HstapError, match="was not written by hstap prompts"):
        build_prompts(PromptsConfig(out=out, total=1, sources=["code"], code_packages=["json"]), progress=False)


class ScriptedSampler:
    """Stands in for MagpieSampler where the test is about bookkeeping, not the model: attempt a always yields the
    same text; every third is unfinished and every fifth repeats the one before, so drops of several kinds occur."""

    nouns = ("cat tide bridge prime jazz glacier compiler tea river engine poem market violin comet forest "
             "ledger harbor crystal tunnel orchard").split()

    def __init__(self, target, seed: int, batch_size: int, **sampling):
        self.batch_size, self.special_strings = batch_size, ["<|im_end|>"]

    def round(self, start: int) -> list[Candidate]:
        return [self._candidate(a) for a in range(start, start + self.batch_size)]

    def _candidate(self, a: int) -> Candidate:
        k = a - 1 if a % 5 == 4 else a
        n = self.nouns
        text = f"Can you tell me about the {n[k % 20]} of the {n[(3 * k + 1) % 20]} and the {n[(7 * k + 2) % 20]}?"
        return Candidate(attempt=a, category=CATEGORIES[a % 8], variant=0, text=text, n_tokens=16,
                         finish_reason="length" if a % 3 == 2 else "stop")

    def close(self) -> None:
        pass


def test_magpie_killed_inside_a_round_resumes_to_the_same_file_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_module, "MagpieSampler", ScriptedSampler)
    model = SimpleNamespace(model_id="scripted", fingerprint="0")

    def cfg(out):
        return PromptsConfig(out=out, total=7, sources=["magpie"], batch_size=4)

    straight = build_prompts(cfg(tmp_path / "a.jsonl"), target=model, progress=False)
    write, writes = JsonlAppender.write, []

    def dies_on_the_fifth(self, record):
        writes.append(record["id"])
        if len(writes) == 5:  # attempts 0, 1, 3 (round 1, saved), 6, then 7: killed inside round 2
            raise KeyboardInterrupt
        write(self, record)

    monkeypatch.setattr(JsonlAppender, "write", dies_on_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        build_prompts(cfg(tmp_path / "b.jsonl"), target=model, progress=False)
    monkeypatch.setattr(JsonlAppender, "write", write)
    resumed = build_prompts(cfg(tmp_path / "b.jsonl"), target=model, progress=False)
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    a, b = straight.tallies["magpie"], resumed.tallies["magpie"]
    assert (b.examined, b.kept, b.dropped) == (a.examined, a.kept, a.dropped)
    assert a.adds_up() and a.kept == 7 and {"unfinished", "exact_duplicate", "surplus"} <= set(a.dropped)


def test_sharegpt_max_chars_passes_over_long_first_turns_and_counts_them(tmp_path):
    """The demo's small runs keep short ShareGPT prompts (a long one costs prefill, not answers): a conversation
    whose first user turn is over the cap is never written, and each one passed over is counted by its reason."""
    out = tmp_path / "short.jsonl"
    cfg = PromptsConfig(out=out, total=6, sources=["sharegpt:1"], sharegpt_max_chars=120)
    result = build_prompts(cfg, target=None, progress=False)
    records = _records(out)
    assert len(records) == 6
    assert all(len(next(m["content"] for m in r["messages"] if m["role"] == "user")) <= 120 for r in records)
    tally = result.tallies["sharegpt"]
    assert tally.dropped.get("first_turn_over_120_chars", 0) > 0
    assert tally.examined == 6 + sum(tally.dropped.values())
