"""The held-out τ estimate replays decoding: on the target's own greedy answers it equals the τ that real chain
speculative decoding measures with the same drafter (fp32, CPU), cycle for cycle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hstap.data import load_mtbench, render_prompt
from hstap.data.render import RenderedSample
from hstap.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from hstap.drafter.vocab import target_to_draft_ids
from hstap.evaluate.results import MethodResult
from hstap.evaluate.methods import Methods
from hstap.runtime.shapes import DraftShape
from hstap.train.heldout import first_answers, replayed_first_answers
from hstap.train.online import DeviceOnlineSource
from hstap.train.ttt import simulated_tau, ttt_forward

NEW, EXTRA, CHAIN = 24, 8, 3


def test_simulation_walks_cycles_per_answer_segment():
    # one row: prompt [0, 2), answer [2, 10); runs at positions 1.. as step 0 sees them
    answer = torch.tensor([[False, False] + [True] * 8])
    runs = torch.tensor([[0, 3, 0, 0, 2, 0, 0, 0, 0, 0]])
    # committed c=2: run[1]=3 → 4 tokens (c=6); run[5]=0 → 1 (c=7); run[6]=0 → 1 (c=8); run[7]=0 → 1 (c=9 = end)
    assert simulated_tau(runs, answer, 3) == (pytest.approx(7 / 4), 4)
    # chain of 1, runs capped at 1: c=2→4 (run[1]), 4→5 (run[3]), 5→7 (run[4]), 7→8, 8→9
    assert simulated_tau(runs, answer, 1) == (pytest.approx(7 / 5), 5)
    # the last cycle is cut at the answer's end, or where a new-token limit stops decoding
    runs_end = torch.tensor([[0, 0, 0, 0, 0, 0, 3, 0, 0, 0]])
    answer_end = torch.tensor([[False] * 7 + [True] * 3])
    assert simulated_tau(runs_end, answer_end, 3) == (pytest.approx(2.0), 1)  # tokens 8, 9 and the end
    assert simulated_tau(runs_end, answer_end, 3, max_new_tokens=2) == (pytest.approx(1.0), 1)  # token 8 only


def test_simulated_tau_equals_measured_chain_decoding(target, tokenizer):
    torch.manual_seed(0)
    model = target.model
    prompts = [render_prompt(q.messages[:1], tokenizer) for q in load_mtbench()[:3]]
    # the target's own greedy answers, a little longer than the decoding below so no cycle runs off their end
    vanilla = Methods(model, None, len(prompts), max(map(len, prompts)) + NEW + EXTRA).run(
        None, prompts, NEW + EXTRA, stop_ids=set())
    samples = [RenderedSample(str(i), p + g.tokens, [False] * len(p) + [True] * len(g.tokens))
               for i, (p, g) in enumerate(zip(prompts, vanilla))]
    layers = [1, 14, 26]
    source = DeviceOnlineSource(target, samples, layers, dtype="fp32")
    batch = source.batch(list(range(len(samples))))
    counts = torch.bincount(batch.input_ids.flatten(), minlength=model.config.vocab_size)
    cfg = DrafterConfig.from_target(model.config, layers, 1024, target.model_id, target.fingerprint)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(model, *build_draft_vocab(counts, 1024))
    t2d_ids = target_to_draft_ids(drafter.d2t, model.config.vocab_size)
    # memorise these answers: a drafter that is right often, wrong sometimes, so τ is far from 1 and from 4
    optim = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(10):
        optim.zero_grad()
        ttt_forward(drafter, batch, t2d_ids, steps=CHAIN).loss.backward()
        optim.step()
    drafter.eval()
    with torch.no_grad():
        out = ttt_forward(drafter, batch, t2d_ids, steps=CHAIN)
    simulated, cycles = simulated_tau(out.run_lengths, batch.loss_mask & batch.valid, CHAIN, max_new_tokens=NEW)

    shape = DraftShape.parse(f"chain:{CHAIN}")
    methods = Methods(model, drafter, len(prompts), max(map(len, prompts)) + NEW, [shape])
    measured = MethodResult(shape.spec, shape, methods.run(shape, prompts, NEW, stop_ids=set()))
    assert 1.5 < measured.tau < CHAIN + 0.5, "a drafter this test can tell apart from 1 and from perfect"
    assert cycles == measured.verify_forwards
    assert simulated == pytest.approx(measured.tau, abs=1e-9)
    # what training's calibration logs beside its measurement: the same estimate, through the source
    cfg = SimpleNamespace(ttt_steps=CHAIN, decay=0.8, ttt_attention="auto")
    same = replayed_first_answers(drafter, source, list(range(len(samples))), layers, t2d_ids, cfg,
                                  torch.device("cpu"), CHAIN, NEW)
    assert same == pytest.approx(measured.tau, abs=1e-9)


def test_first_answers_keeps_each_rows_first_answer_segment():
    answer = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    want = torch.tensor([[0, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(first_answers(answer), want)
