"""The decode loop against `model.generate`, the runtime (static cache, lean forward) against transformers' own
DynamicCache path, sampling, the Engine (plain and speculative)."""

from __future__ import annotations

import threading

import pytest
import torch

from hstap.data import open_source, render_prompt
from hstap.runtime.decode import EagerStepper, Request, decode, left_pad
from hstap.errors import HstapError
from hstap.runtime.engine import Engine, OverPositions
from hstap.runtime.target import Runtime

NEW = 16


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Real ShareGPT first turns of different lengths plus one that the model answers in a few tokens (EOS)."""
    convs = list(open_source("sharegpt", limit=4))
    real = [render_prompt(c.messages[:1], target.tokenizer) for c in convs]
    short = render_prompt([{"role": "user", "content": "Is the sky blue? Answer yes or no."}], target.tokenizer)
    out = [p for p in real if len(p) <= 160][:3] + [short]
    assert len({len(p) for p in out}) == len(out), "prompts of different lengths exercise the left padding"
    return out


def _decode(target, stepper, requests, generator=None):
    with torch.inference_mode():
        return decode(stepper, requests, target.tokenizer.pad_token_id, target.stop_ids,
                      "cpu", generator)


@pytest.fixture(scope="module")
def eager(target, prompts):
    return _decode(target, EagerStepper(target.model), [Request(p, NEW) for p in prompts])


def test_greedy_equals_generate_token_for_token(target, prompts, eager):
    pad = target.tokenizer.pad_token_id
    ids, mask = left_pad(prompts, pad, "cpu")
    with torch.inference_mode():
        ref = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    ref = ref[:, ids.shape[1]:].tolist()
    assert {g.finish_reason for g in eager} == {"stop", "length"}, "cover both ways a row ends"
    for gen, want, prompt in zip(eager, ref, prompts):
        produced = gen.tokens + ([target.tokenizer.eos_token_id] if gen.finish_reason == "stop" else [])
        assert produced == want[:len(produced)]
        assert all(t == pad for t in want[len(produced):]), "generate pads a finished row"
        assert gen.prompt_tokens == len(prompt) and gen.completion_tokens == len(produced)


def test_runtime_equals_eager(target, prompts, eager):
    # batch_size above the row count: the dummy rows a CUDA graph pads with are exercised too
    stepper = Runtime(target.model, batch_size=len(prompts) + 2, max_len=2048, cuda_graphs=False)
    static = _decode(target, stepper, [Request(p, NEW) for p in prompts])
    assert [(g.tokens, g.finish_reason) for g in static] == [(g.tokens, g.finish_reason) for g in eager]


def test_per_row_max_new_tokens(target, prompts, eager):
    limits = [3, NEW, 7, NEW]
    gens = _decode(target, EagerStepper(target.model), [Request(p, n) for p, n in zip(prompts, limits)])
    for gen, full, n in zip(gens, eager, limits):
        assert gen.tokens == full.tokens[:n]
        assert gen.finish_reason == ("length" if len(full.tokens) >= n and n < NEW else full.finish_reason)


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(target, prompts, eager):
    rows = [1, 3]  # the two shortest prompts

    def sample(seed, top_p=1.0):
        g = torch.Generator().manual_seed(seed)
        reqs = [Request(prompts[k], 8, temperature=1.0, top_p=top_p) for k in rows]
        return [x.tokens for x in _decode(target, EagerStepper(target.model), reqs, g)]

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first
    assert sample(3, top_p=1e-6) == [eager[k].tokens[:8] for k in rows]


def test_engine_batches_requests_from_threads(target, prompts, eager):
    engine = Engine(target, max_batch=4)
    results = [None] * len(prompts)

    def ask(k):
        results[k] = engine.submit(Request(prompts[k], NEW)).result(timeout=120)

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    engine.close()
    # whatever the batches were, greedy answers do not depend on their neighbours (up to fp32 reassociation)
    assert sum(r.tokens[:8] == e.tokens[:8] for r, e in zip(results, eager)) == len(prompts)
    with pytest.raises(Exception, match="closed"):
        engine.submit(Request(prompts[0], 4))


def test_speculative_engine_gives_the_plain_answers_and_counts_tau(target, prompts, eager):
    engine = Engine(target, max_batch=4, draft="ngram:3")
    try:
        limits = [8, 5, 8, 8]  # per-row max_new_tokens cut the speculative rows too
        gens = engine.generate([Request(p, n) for p, n in zip(prompts, limits)])
        stats = engine.spec_stats()
    finally:
        engine.close()
    for gen, ref, n in zip(gens, eager, limits):
        assert gen.tokens == ref.tokens[:n]
        assert gen.finish_reason == ("length" if n < len(ref.tokens) + (ref.finish_reason == "stop") else
                                     ref.finish_reason)
    assert stats["draft"] == "ngram:3" and stats["verify_forwards"] > 0 and stats["tau"] >= 1.0


@pytest.mark.parametrize("draft", [None, "ngram:3"])  # continuous rows; speculative verifications
def test_listeners_get_tokens_as_decoded_and_can_free_the_row(target, prompts, eager, draft):
    engine = Engine(target, max_batch=4, draft=draft)
    seen, kept = [], []
    try:
        gen = engine.submit(Request(prompts[0], NEW), on_tokens=lambda new: seen.append(new) or True).result(120)
        cut = engine.submit(Request(prompts[0], NEW), on_tokens=lambda new: kept.append(new) or len(kept) < 2)
        cut = cut.result(120)
        stats = engine.batch_stats()
    finally:
        engine.close()
    assert [t for new in seen for t in new] == gen.tokens == eager[0].tokens and len(seen) > 1  # in pieces
    assert cut.tokens == [t for new in kept for t in new] and len(kept) == 2 and len(cut.tokens) < NEW  # stopped
    assert stats == {"active": 0, "max_rows": 1, "ended_early": 1}


def test_prompt_past_the_context_is_refused(target):
    """The one check of the prompt-length rule: at submit, an HstapError (OverPositions, which synth files as never
    to retry) in one line naming the sizes, the limit and what would fit."""
    engine = Engine(target, max_batch=2, max_len=64)
    try:
        with pytest.raises(OverPositions) as info:
            engine.submit(Request(list(range(60)), 10))
        assert isinstance(info.value, HstapError) and str(info.value) == (
            "prompt of 60 tokens + max_new_tokens 10 exceeds the model's 64 positions: max_new_tokens 4 would fit")
        with pytest.raises(OverPositions, match="64 positions: shorten the prompt$"):
            engine.submit(Request(list(range(64)), 1))
        assert engine.generate([Request(list(range(1, 60)), 5)])[0].prompt_tokens == 59, "a request that fits runs"
    finally:
        engine.close()


def _first_divergences(ours, ref_tokens):
    """(row, step) of each row's first token that differs from the reference's."""
    out = []
    for row, (g, r) in enumerate(zip(ours, ref_tokens)):
        step = next((i for i, (a, b) in enumerate(zip(g.tokens, r)) if a != b), None)
        if step is not None:
            out.append((row, step))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_graph_decode_equals_static_eager_and_generate(dtype):
    """fp32: the graph-replayed runtime gives generate's tokens, every one. bf16: it may leave generate's path only
    where generate's own top two logits were within two bf16 ulps (a rounding tie: on 2026-12-03 the H200 showed
    4 of 8 rows leaving it, every one at a gap of 0 or 1 ulp), never at a decided token."""
    from hstap.models import load_target

    target = load_target("smollm2", device="cuda", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    convs = list(open_source("sharegpt", limit=8))
    prompts = [render_prompt(c.messages[:1], target.tokenizer)[:200] for c in convs]
    pad, stops = target.tokenizer.pad_token_id, target.stop_ids
    reqs = [Request(p, 32) for p in prompts]
    with torch.inference_mode():
        graph = decode(Runtime(target.model, 16, 2048, cuda_graphs=True), reqs, pad, stops, "cuda",
                       sync_every=8)
        plain = decode(Runtime(target.model, 16, 2048, cuda_graphs=False), reqs, pad, stops, "cuda")
        ids, mask = left_pad(prompts, pad, "cuda")
        ref = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[:, ids.shape[1]:].tolist()
    if dtype == "fp32":
        assert [g.tokens for g in graph] == [p.tokens for p in plain] == ref_tokens
        return
    # same ops, but cuBLAS may pick other algorithms under capture: bf16 rounding can flip a late token
    assert all(g.tokens[:8] == p.tokens[:8] for g, p in zip(graph, plain))
    assert sum(g.tokens == p.tokens for g, p in zip(graph, plain)) >= len(reqs) - 2
    for row, step in _first_divergences(graph, ref_tokens):
        scores = ref.scores[step][row].float()
        ours, theirs = graph[row].tokens[step], ref_tokens[row][step]
        ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(scores[theirs].abs()))
        assert scores[theirs] - scores[ours] <= 2 * ulp, (row, step, float(scores[theirs] - scores[ours]))


@pytest.mark.parametrize("rows, width, heads, chunks", [
    (4, 100, 9, [(0, 4)]),  # small: one forward
    (256, 4096, 9, [(r, r + 14) for r in range(0, 252, 14)] + [(252, 256)]),  # bounded by the attention scores
    (256, 512, 9, [(r, r + 128) for r in range(0, 256, 128)]),  # bounded by the tokens
    (3, 60000, 9, [(0, 1), (1, 2), (2, 3)]),  # one row per forward at the least
])
def test_prefill_chunks_bound_tokens_and_scores(rows, width, heads, chunks):
    from hstap.runtime.target import prefill_chunks

    assert prefill_chunks(rows, width, heads) == chunks


def test_chunked_prefill_equals_one_forward(target, monkeypatch):
    """Rows prefilled in chunks give the same logits and cache as one forward (the OOM fix must not change
    a token)."""
    import hstap.runtime.target as target_module

    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
    ids, mask = left_pad(prompts, 0, "cpu")

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        rt = Runtime(target.model, batch_size=3, max_len=64, cuda_graphs=False)
        logits = rt.prefill(ids, mask, 8)
        return logits, rt.slot.kv.data.clone()

    whole = run()
    monkeypatch.setattr(target_module, "PREFILL_TOKENS", 6)  # one 6-token row per forward
    chunked = run()
    # One padded forward and three one-row ones round differently: transformers' prefill takes different SDPA
    # paths (masked vs causal), the lean one (the default) other GEMM shapes; fp32 rounding through 30 layers
    # moved a logit by up to ~4e-3 of ~33 (CI, 2026-12-01, transformers' prefill; 1e-4 of the row's norm). A row
    # loaded at the wrong offset or logits concatenated out of order differ by O(1), so bound each row's
    # relative error at 1e-3 and require the same next token.
    assert torch.equal(chunked[0].argmax(-1), whole[0].argmax(-1))
    for row in range(len(prompts)):
        for got, ref in ((chunked[0][row], whole[0][row]), (chunked[1][:, row], whole[1][:, row])):
            rel = float((got - ref).norm() / ref.norm())
            assert rel < 1e-3, f"row {row}: relative error {rel:.2e}"


def test_an_evicted_slot_frees_its_cache_before_the_next_is_allocated(target, prompts):
    """Synth on the H200 ran out of memory twice (2026-12-01): an evicted slot stayed alive — the runtime still
    pointed at it, and its graphs refer back to it — so its cache (up to ~50 GB) sat beside the new one."""
    import gc
    import weakref

    stepper = Runtime(target.model, batch_size=2, max_len=1024, cuda_graphs=False, len_bucket=64, max_slots=1,
                      rehearse=True)
    gc.disable()  # only the runtime's own collection may free the cycle
    try:
        _decode(target, stepper, [Request(p, 4) for p in prompts[:2]])  # graphs built on this slot
        old = weakref.ref(stepper.slot.kv.data)
        long_prompt = [prompts[0] * 4]
        _decode(target, stepper, [Request(long_prompt[0], 4)])  # another length bucket: the first slot goes
        assert len(stepper.slots) == 1
        assert old() is None, "the evicted slot's KV cache is still alive"
    finally:
        gc.enable()
