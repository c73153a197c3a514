"""`run_synth` with the embedded SmolLM2 on real prompts: records, re-rendering, resume, filters, multi-turn, and
`hstap capture` consuming the output."""

from __future__ import annotations

import asyncio

import pytest

from hstap.cli import main
from hstap.errors import HstapError
from hstap.data import Conversation, iter_jsonl, open_source, render, render_prompt
from hstap.runtime.engine import Engine, Request
from hstap.store import open_store
from hstap.synth.backend import Completion, RequestFailed
from hstap.synth.config import SynthConfig
from hstap.synth.run import answer, run_synth
from tests.synth.conftest import read_records, write_jsonl

NEW = 12


def _cfg(out, **kw) -> SynthConfig:
    return SynthConfig(**{"model": "smollm2", "data": "sharegpt", "out": out, "max_new_tokens": NEW,
                          "batch_size": 4, **kw})


@pytest.fixture(scope="module")
def sharegpt_out(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("synth") / "sharegpt.jsonl"
    result = run_synth(_cfg(out, limit=3), progress=False, target=target)
    assert result.written == 3 and result.failed == 0, result.summary()
    return out


def test_records_are_the_targets_answers_in_chat_format(sharegpt_out, target):
    records = read_records(sharegpt_out)
    sources = {c.id: c for c in open_source("sharegpt", limit=3)}
    assert {r["id"] for r in records} == set(sources)
    engine = Engine(target, max_batch=1)
    try:
        for r in records:
            conv = sources[r["id"]]
            assert r["source_id"] == r["id"] and r["source"] == "sharegpt"
            assert r["model"] == target.model_id
            assert r["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": NEW, "seed": 0}
            assert r["messages"][0] == conv.messages[0] and r["messages"][1]["role"] == "assistant"
            assert len(r["messages"]) == 2, "--turns first answers the first user turn only"
            assert r["messages"][1]["content"] != conv.messages[1]["content"], "the dataset's answer is replaced"
            gen = engine.generate([Request(render_prompt(conv.messages[:1], target.tokenizer), NEW)])[0]
            assert (r["finish_reason"], r["completion_tokens"]) == (gen.finish_reason, gen.completion_tokens)
            assert r["prompt_tokens"] == gen.prompt_tokens
            # what capture will train on: the rendered answer is the target's very tokens (+ end of turn)
            sample = render(Conversation(r["id"], r["messages"], "x"), target.tokenizer)
            masked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
            assert masked == gen.tokens + [target.tokenizer.eos_token_id]
    finally:
        engine.close()


def test_rerun_appends_only_the_missing_ids(sharegpt_out, target, tmp_path):
    copy = tmp_path / "o.jsonl"
    copy.write_bytes(sharegpt_out.read_bytes())
    result = run_synth(_cfg(copy, limit=4), progress=False, target=target)
    assert result.resumed == 3 and result.written == 1
    ids = [r["id"] for r in read_records(copy)]
    assert len(ids) == len(set(ids)) == 4
    assert ids[:3] == [r["id"] for r in read_records(sharegpt_out)]


def test_static_batches_give_the_same_greedy_answers(sharegpt_out, target, tmp_path, monkeypatch):
    """--no-continuous (static batches, the default on CUDA) reaches the engine, and greedy answers do not depend
    on how rows are batched (the CPU default refills rows)."""
    import hstap.synth.embedded as embedded

    engines = []

    class Spy(Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            engines.append(self)

    monkeypatch.setattr(embedded, "Engine", Spy)
    out = tmp_path / "static.jsonl"
    result = run_synth(_cfg(out, limit=3, continuous=False), progress=False, target=target)
    assert result.written == 3 and [e.continuous for e in engines] == [False]
    answers = {r["id"]: r["messages"][1]["content"] for r in read_records(out)}
    assert answers == {r["id"]: r["messages"][1]["content"] for r in read_records(sharegpt_out)}


def test_duplicates_and_truncated_answers_are_dropped_and_counted(tmp_path, target):
    ask = "Is the sky blue? Answer yes or no."
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": ask}]},
        {"id": "b", "messages": [{"role": "user", "content": ask}]},
        {"id": "c", "messages": [{"role": "user", "content": "Tell me a long story about dragons."}]},
    ])
    result = run_synth(_cfg(tmp_path / "o.jsonl", data=f"jsonl:{data}", max_new_tokens=6, drop_truncated=True),
                       progress=False, target=target)
    assert [r["id"] for r in read_records(tmp_path / "o.jsonl")] == ["a"]
    assert result.report.counts == {"duplicate_prompt": 1, "truncated_answer": 1}
    assert "duplicate_prompt=1" in result.summary() and "truncated_answer=1" in result.summary()


def test_multi_turn_feeds_back_the_targets_own_answers(tmp_path, target):
    u1, u2 = "Name a fruit that is red.", "What color is it inside?"
    data = write_jsonl(tmp_path / "mt.jsonl", [{"id": "m", "messages": [
        {"role": "system", "content": "You are brief."}, {"role": "user", "content": u1},
        {"role": "assistant", "content": "ORIGINAL ANSWER"}, {"role": "user", "content": u2},
        {"role": "assistant", "content": "ORIGINAL ANSWER 2"}]}])
    run_synth(_cfg(tmp_path / "o.jsonl", data=f"jsonl:{data}", turns="all"), progress=False, target=target)
    (rec,) = read_records(tmp_path / "o.jsonl")
    msgs = rec["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert len(rec["turns"]) == 2 and rec["completion_tokens"] == sum(t["completion_tokens"] for t in rec["turns"])
    engine = Engine(target, max_batch=1)
    try:
        def greedy(messages):
            gen = engine.generate([Request(render_prompt(messages, target.tokenizer), NEW)])[0]
            return target.tokenizer.decode(gen.tokens)

        assert msgs[2]["content"] == greedy(msgs[:2])
        assert msgs[4]["content"] == greedy(msgs[:4]), "turn 2 was answered after the target's own turn 1"
    finally:
        engine.close()


class _Stub:
    model_id = "stub"

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    async def complete(self, messages, sampling):
        self.asked.append([dict(m) for m in messages])
        item = self.answers.pop(0)
        if isinstance(item, Exception):
            raise item
        return Completion(content=item, finish_reason="stop", prompt_tokens=3, completion_tokens=2)


def test_answer_drops_empty_answers_and_names_the_failed_turn(tmp_path):
    conv = Conversation("x", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}], "test")
    cfg = SynthConfig(model="m", out=tmp_path / "o.jsonl", turns="all")
    assert asyncio.run(answer(conv, _Stub(["  \n"]), cfg)) == (None, "empty_answer")
    with pytest.raises(RequestFailed, match="turn 1: boom"):
        asyncio.run(answer(conv, _Stub(["fine", RequestFailed("boom")]), cfg))
    stub = _Stub(["one", "two"])
    record, _ = asyncio.run(answer(conv, stub, cfg))
    assert stub.asked[1] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                             {"role": "user", "content": "c"}]
    assert record["messages"][-1] == {"role": "assistant", "content": "two"}


def test_capture_consumes_the_output(sharegpt_out, tmp_path):
    store = tmp_path / "store"
    code = main(["capture", "--data", f"jsonl:{sharegpt_out}", "--limit", "3", "--out", str(store),
                 "--max-tokens", "256"])
    assert code == 0
    assert open_store(store).ids() == [c.id for c in iter_jsonl(sharegpt_out)]


def test_cli_plan_and_missing_backend(tmp_path, capsys):
    assert main(["synth", "--model", "smollm2", "--out", str(tmp_path / "o.jsonl"), "--limit", "2", "--plan"]) == 0
    assert "  limit: 2\n" in capsys.readouterr().out and not (tmp_path / "o.jsonl").exists()
    assert main(["synth", "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "--server" in err


def test_a_full_disk_keeps_every_whole_record_and_a_too_long_prompt_is_not_retried(tmp_path, target, monkeypatch):
    """ENOSPC at the 2nd record (HSTAP_FAULT record-write:2:enospc): one line, the first record whole, no cut line;
    the re-run completes the set. A prompt longer than SmolLM2's 8,192 positions fails the same way every time:
    reported as `over_model_positions`, `"retry": false` in the failed file, not as something to re-run for."""
    import hstap.faults as faults
    from hstap.synth.writer import failed_path

    huge = "Please summarise this text. " + "lorem ipsum dolor sit amet " * 2500  # ~10k tokens
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "q1", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"id": "q2", "messages": [{"role": "user", "content": "Name one ocean."}]},
        {"id": "huge", "messages": [{"role": "user", "content": huge}]},
    ])
    out = tmp_path / "o.jsonl"
    cfg = _cfg(out, data=f"jsonl:{data}", max_new_tokens=4, batch_size=1, concurrency=1)
    monkeypatch.setenv("HSTAP_FAULT", "record-write:2:enospc")
    faults.reset()
    with pytest.raises(HstapError, match=r"o.jsonl: No space left on device.* the 1 records before it are whole and "
                                         r"kept: free space, then re-run the same command to resume") as err:
        run_synth(cfg, progress=False, target=target)
    assert "\n" not in str(err.value)
    assert out.read_text().endswith("\n") and len(read_records(out)) == 1
    monkeypatch.delenv("HSTAP_FAULT")

    result = run_synth(cfg, progress=False, target=target)
    assert sorted(r["id"] for r in read_records(out)) == ["q1", "q2"] and result.resumed == 1
    assert result.failed == 0 and result.permanent == {"over_model_positions": 1}
    (line,) = read_records(failed_path(out))
    assert line["id"] == "huge" and line["retry"] is False and "exceeds the model's 8192 positions" in line["reason"]
    summary = result.summary()
    assert "not retried 1: they can never succeed as asked (over_model_positions=1)" in summary
    assert "retry them" not in summary


def test_a_second_synth_on_the_same_file_is_refused_before_the_model_loads(tmp_path, capsys):
    """Two synths into one file: the second stops in one line (the first holds the lock), the file is untouched."""
    from hstap.synth.writer import SynthWriter

    out = tmp_path / "o.jsonl"
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    with SynthWriter(out) as first:
        first.write({"id": "x", "messages": []})
        code = main(["synth", "--model", "/no/such/model", "--data", f"jsonl:{data}", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "is being written by another hstap synth run" in err
    assert [r["id"] for r in read_records(out)] == ["x"]
