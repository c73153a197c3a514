"""τ of greedy speculative decoding replayed on the target's own greedy answers, without a decoding loop (here, not
in evaluate/, because it runs the training-time unroll: train may import evaluate, not the reverse).

With greedy verification, what a cycle accepts is decided by the answer itself: the drafts are compared with the
tokens the target would produce anyway. So once the greedy answer is known, the τ of every draft shape follows
from one teacher-forced pass: the drafter's chain runs come from a TTT unroll over prompt + answer
(`hstap.train.ttt.ttt_forward`, exact for chains: tests/train/test_simulated_tau.py), prompt lookup from the
tokens alone. A CPU replays 80 MT-bench answers in minutes where the decoding loop needs hours; bench/spec_decode.py
then measures the speed of the shapes worth keeping.

    answers = greedy_answers(target, prompts, max_new_tokens=128)
    runs = chain_runs(target, drafter, answers, depth=3)
    replay(answers, runs, DraftShape.parse("hybrid:3,2"), max_new_tokens=128)   # → (tokens, cycles)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstap.data.render import RenderedSample
from hstap.drafter.vocab import target_to_draft_ids
from hstap.runtime.shapes import DraftShape


@dataclass
class Answer:
    """A prompt and the target's greedy answer to it (stop token included when one ended it)."""

    id: str
    prompt: list[int]
    answer: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.answer


def greedy_answers(target, prompts, max_new_tokens: int, batch_size: int = 16) -> list[Answer]:
    """The target's greedy answers on hstap's runtime (the vanilla decoding of `hstap eval`)."""
    from hstap.evaluate.methods import Methods

    out: list[Answer] = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i: i + batch_size]
        longest = max(len(p.ids) for p in batch) + max_new_tokens
        methods = Methods(target.model, None, len(batch), longest)
        gens = methods.run(None, [p.ids for p in batch], max_new_tokens, set(target.stop_ids))
        out += [Answer(p.id, p.ids, g.tokens) for p, g in zip(batch, gens)]
    return out


@torch.no_grad()
def chain_runs(target, drafter, answers: list[Answer], depth: int, batch_size: int = 8) -> list[list[int]]:
    """Per answer, for every position t: how many of the drafter's chain drafts from t would be accepted (≤ depth)
    — step 0 at t reads the target's layers at t and token t+1 and drafts token t+2 (`ttt_forward`)."""
    from hstap.train.online import DeviceOnlineSource
    from hstap.train.ttt import ttt_forward

    samples = [RenderedSample(a.id, a.tokens, [False] * len(a.prompt) + [True] * len(a.answer)) for a in answers]
    cfg = drafter.config
    dtype = "fp32" if target.model.dtype == torch.float32 else "bf16"
    source = DeviceOnlineSource(target, samples, list(cfg.aux_layer_ids), dtype=dtype,
                                device=str(target.model.device))
    t2d_ids = target_to_draft_ids(drafter.d2t, cfg.vocab_size).to(target.model.device)
    runs: list[list[int]] = []
    for i in range(0, len(samples), batch_size):
        batch = source.batch(list(range(i, min(i + batch_size, len(samples)))))
        out = ttt_forward(drafter, batch, t2d_ids, steps=depth)
        runs += [row[: len(samples[i + j].input_ids)] for j, row in enumerate(out.run_lengths.tolist())]
    return runs


def lookup(tokens: list[int], c: int, depth: int, match: int) -> tuple[list[int], int]:
    """Prompt lookup as `hstap.runtime.proposals.draft_ngram` does it with token c the root: the `depth` tokens after
    the latest earlier occurrence of tokens[c-n+1 .. c], n = match .. 1, the longest found; → (draft, n), n = 0
    and the root repeated when nothing matched. Drafts past the context repeat the root."""
    for n in range(match, 0, -1):
        if c - n + 1 < 0:
            continue
        suffix = tokens[c - n + 1: c + 1]
        for start in range(c - n, -1, -1):  # windows that end before the root, latest first
            if tokens[start: start + n] == suffix:
                follow = [tokens[min(start + n + k, c)] for k in range(depth)]
                return follow, n
    return [tokens[c]] * depth, 0


def _accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def replay(answers: list[Answer], runs: list[list[int]] | None, shape: DraftShape,
           max_new_tokens: int) -> tuple[int, int]:
    """Tokens kept and verification cycles of greedy decoding with `shape` (chain, ngram or hybrid) over every
    answer, as the runtime counts them (the prefill's first token not counted, the last cycle cut at the end)."""
    if shape.kind == "tree":
        raise ValueError("replay covers chains, prompt lookup and hybrids; a tree needs the decoding loop")
    tokens = cycles = 0
    for i, a in enumerate(answers):
        seq, p = a.tokens, len(a.prompt)
        end = p + min(len(a.answer), max_new_tokens) - 1  # the last answer token decoding keeps
        c = p  # the last committed token: the prefill's
        while c < end:
            truth = seq[c + 1: c + 1 + shape.depth]
            if shape.kind == "chain":
                accepted = min(runs[i][c - 1], shape.depth)
            else:
                draft, n = lookup(seq, c, shape.depth, shape.match)
                accepted = _accepted(draft, truth)
                if shape.kind == "hybrid" and n < shape.match:
                    accepted = min(runs[i][c - 1], shape.depth)
            produced = min(accepted + 1, end - c)
            tokens, cycles, c = tokens + produced, cycles + 1, c + produced
    return tokens, cycles
