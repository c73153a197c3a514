"""Continuous batching (hstap.runtime.stream): rows refilled mid-flight give every request the answer it gets
alone, finished requests leave at once, a request too long for the session waits for the next, and a failure
fails the session's requests only. Real SmolLM2 and ShareGPT prompts, fp32, greedy."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from hstap.data import open_source, render_prompt
from hstap.runtime.decode import EagerStepper, Request, decode
from hstap.runtime.engine import Engine
from hstap.runtime.stream import Session
from hstap.runtime.target import Runtime


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Five real ShareGPT first turns of different lengths and one the model answers in a few tokens (EOS)."""
    convs = list(open_source("sharegpt", limit=12))
    real = sorted({len(p): p for p in (render_prompt(c.messages[:1], target.tokenizer) for c in convs)
                   if len(p) <= 200}.values(), key=len)[:5]
    short = render_prompt([{"role": "user", "content": "Is the sky blue? Answer yes or no."}], target.tokenizer)
    assert len(real) == 5
    return real + [short]


_ALONE: dict[tuple, object] = {}


def alone(target, request: Request):
    """The reference: the request as a batch of its own on transformers' DynamicCache. Kept per request:
    both parametrizations of the refill test and the later tests ask for the same answers (half of the file's time
    went into decoding them again)."""
    key = (tuple(request.prompt), request.max_new_tokens, request.temperature, request.top_p, request.seed)
    if key not in _ALONE:
        with torch.inference_mode():
            _ALONE[key] = decode(EagerStepper(target.model), [request], target.tokenizer.pad_token_id,
                                 target.stop_ids, "cpu")[0]
    return _ALONE[key]


def run_session(target, runtime, requests, poll=None, admit_spy=None):
    """One Session over `requests` (tags = their indices); → (delivered [(tag, gen)] in order, what still waits)."""
    waiting = deque(enumerate(requests))
    delivered, failed = [], []
    session = Session(runtime, target.tokenizer.pad_token_id, target.stop_ids, sync_every=1)
    if admit_spy is not None:
        real = runtime.admit

        def spy(rows, ids, mask):
            admit_spy.append((list(rows), [b.tag for b in session.busy if b is not None]))
            return real(rows, ids, mask)

        runtime.admit = spy
    with torch.inference_mode():
        session.run(waiting, poll or (lambda: True), lambda tag, gen: delivered.append((tag, gen)),
                    lambda tag, exc: failed.append((tag, exc)))
    assert not failed, failed
    return delivered, waiting


@pytest.mark.parametrize("rehearse", [False, True], ids=["eager", "graph-path"])
def test_refilled_rows_answer_as_if_alone(target, prompts, rehearse):
    """Six requests (per-row limits 3..20) through two rows: four are admitted while the other row is mid-answer,
    and each answer equals that request decoded alone, token for token; `rehearse` runs the CUDA-graph path's
    bookkeeping (full-width attention, capture warm-ups with their state restore) on the CPU."""
    requests = [Request(p, n) for p, n in zip(prompts, [12, 3, 20, 7, 16, 20])]
    runtime = Runtime(target.model, batch_size=2, max_len=2048, cuda_graphs=False, rehearse=rehearse)
    admits = []
    delivered, waiting = run_session(target, runtime, requests, admit_spy=admits)
    assert not waiting and sorted(tag for tag, _ in delivered) == list(range(len(requests)))
    assert sum(1 for _, beside in admits if beside) >= 3, f"rows refilled beside a busy row: {admits}"
    got = dict(delivered)
    for tag, request in enumerate(requests):
        ref = alone(target, request)
        assert (got[tag].tokens, got[tag].finish_reason, got[tag].stop_token) == \
            (ref.tokens, ref.finish_reason, ref.stop_token), tag
        assert got[tag].prompt_tokens == len(request.prompt)
    assert {g.finish_reason for g in got.values()} == {"stop", "length"}, "cover both ways a row ends"


def test_a_request_arriving_mid_answer_starts_and_leaves_before_it_ends(target, prompts):
    """One row busy with a 24-token answer; a 4-token request that arrives at the 3rd poll is admitted into the
    free row at once and delivered first (a static batch would hold it until the next batch)."""
    long, short = Request(prompts[2], 24), Request(prompts[0], 4)
    waiting_box: list[deque] = []
    polls = [0]

    def poll() -> bool:
        polls[0] += 1
        if polls[0] == 3:
            waiting_box[0].append(("short", short))
        return True

    runtime = Runtime(target.model, batch_size=2, max_len=2048, cuda_graphs=False)
    waiting = deque([("long", long)])
    waiting_box.append(waiting)
    delivered = []
    with torch.inference_mode():
        Session(runtime, target.tokenizer.pad_token_id, target.stop_ids).run(
            waiting, poll, lambda tag, gen: delivered.append((tag, gen)), lambda tag, exc: pytest.fail(str(exc)))
    assert [tag for tag, _ in delivered] == ["short", "long"]
    assert dict(delivered)["short"].tokens == alone(target, short).tokens
    assert dict(delivered)["long"].tokens == alone(target, long).tokens


def test_a_request_longer_than_the_session_waits_for_the_next(target, prompts):
    """The session's cache fits its first rows' requests; a later one that needs more columns stays waiting (FIFO:
    nothing behind it jumps ahead) and the session ends once its rows are done."""
    first, big, small = Request(prompts[0], 8), Request(prompts[1], 40), Request(prompts[0], 4)
    runtime = Runtime(target.model, batch_size=1, max_len=2048, cuda_graphs=False, len_bucket=16)  # slots fit tight
    assert Session(runtime, 0, []).need(big) > -(-Session(runtime, 0, []).need(first) // 16) * 16
    delivered, waiting = run_session(target, runtime, [first, big, small])
    assert [tag for tag, _ in delivered] == [0] and [tag for tag, _ in waiting] == [1, 2]
    delivered, waiting = run_session(target, runtime, [big, small])
    assert not waiting and [tag for tag, _ in delivered] == [0, 1]


def test_closing_finishes_the_rows_in_progress_and_admits_nothing(target, prompts):
    runtime = Runtime(target.model, batch_size=1, max_len=2048, cuda_graphs=False)
    requests = [Request(prompts[0], 5), Request(prompts[1], 5)]
    polls = [0]

    def poll() -> bool:  # open for the first admission, closed from then on
        polls[0] += 1
        return polls[0] == 1

    delivered, waiting = run_session(target, runtime, requests, poll=poll)
    assert [tag for tag, _ in delivered] == [0] and [tag for tag, _ in waiting] == [1]


def test_a_failing_prefill_fails_that_sessions_requests_and_the_engine_serves_on(target, prompts, monkeypatch):
    engine = Engine(target, max_batch=2)
    assert engine.continuous
    try:
        calls = [0]
        real = engine.stepper.admit

        def admit(rows, ids, mask):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("injected: CUDA out of memory")
            return real(rows, ids, mask)

        monkeypatch.setattr(engine.stepper, "admit", admit)
        with pytest.raises(RuntimeError, match="injected"):
            engine.submit(Request(prompts[0], 4)).result(timeout=120)
        again = engine.submit(Request(prompts[0], 4)).result(timeout=120)
        assert again.tokens == alone(target, Request(prompts[0], 4)).tokens
    finally:
        engine.close()


def test_the_engine_streams_many_requests_through_few_rows(target, prompts):
    """The Engine's default on the runtime (on a CPU): seven requests through three rows, each answer as if
    alone."""
    engine = Engine(target, max_batch=3)
    try:
        requests = [Request(prompts[k % len(prompts)], 3 + k) for k in range(7)]
        gens = engine.generate(requests, timeout=300)
    finally:
        engine.close()
    for request, gen in zip(requests, gens):
        assert gen.tokens == alone(target, request).tokens
    speculative = Engine(target, max_batch=2, draft="ngram:3")
    speculative.close()
    assert not speculative.continuous, "speculative batches stay static"
