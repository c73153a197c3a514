"""The drafter at inference: its KV cache of step-0 entries, and chain / EAGLE-2 tree proposals.

Alignment is the training-time test's (hstap.train.ttt). With L committed tokens in the target's cache and the
root (the newest committed token, not yet seen by the target) at position L:

- the drafter cache holds one step-0 entry per position t < L: (target hidden h_t, token t+1) at rotary position t;
  the entry at L-1 pairs h_{L-1} with the root, and its output (`Root`) predicts depth 1;
- a draft node at depth d is a step-d query at rotary position L-1+d, fed with its parent's output hidden and its
  own token; it sees every step-0 entry plus the step-1..d-1 entries of its ancestors and itself.

    state = DraftState(drafter)
    root = state.extend(aux, next_tokens)           # after prefill, and after every verification
    tree = draft_tree(state, root, depth=8, topk=8, nodes=60)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hstap.drafter import Eagle3Drafter, draft_to_target_ids
from hstap.evaluate.sampling import target_probs
from hstap.evaluate.tree import DraftTree, rerank


@dataclass
class Root:
    """Output of the newest step-0 entry: what depth-1 drafts come from."""

    hidden: torch.Tensor  # (H,)
    logits: torch.Tensor  # (Vd,)


class DraftState:
    """The drafter's KV cache for one sequence (batch 1): step-0 keys/values of every position < L."""

    def __init__(self, drafter: Eagle3Drafter):
        cfg = drafter.config
        self.drafter = drafter
        self.rep = cfg.num_attention_heads // cfg.num_key_value_heads
        self.keys: torch.Tensor | None = None  # (1, nkv, L, hd)
        self.values: torch.Tensor | None = None
        self.target_ids = draft_to_target_ids(drafter.d2t)  # (Vd,) draft id → target id

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q (1,nh,S,hd) over keys [cache, k]; allowed (S, L+S) bool."""
        keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)  # (1, nkv, L+S, hd)
        values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(self.rep, 1),
                                              values.repeat_interleave(self.rep, 1), attn_mask=allowed)

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> Root:
        """Append step-0 entries for positions L..L+S-1.

        aux (1, S, n_aux*H_target): the target's captured layers at those positions; next_tokens (1, S): the
        committed token after each of them. Returns the newest entry's output."""
        start, s = self.length, next_tokens.shape[1]
        positions = torch.arange(start, start + s, device=next_tokens.device)[None]  # (1, S)
        allowed = torch.ones(s, start + s, dtype=torch.bool, device=next_tokens.device).tril(start)  # causal

        def attend(q, k, v):
            out = self._attend(q, k, v, allowed)
            self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
            return out

        hidden, logits = self.drafter.step(next_tokens, self.drafter.project(aux), positions, attend)
        return Root(hidden=hidden[0, -1], logits=logits[0, -1])


class _DraftRound:
    """Step-1+ queries of one drafting round: their keys live here, never in the step-0 cache."""

    def __init__(self, state: DraftState):
        self.state = state
        self.keys: torch.Tensor | None = None  # (1, nkv, P, hd), processed draft nodes
        self.values: torch.Tensor | None = None
        self.seen: list[list[int]] = []  # per processed node: the processed nodes it sees (ancestors + itself)

    @torch.no_grad()
    def step(self, tokens: list[int], hidden: torch.Tensor, depth: int,
             parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run nodes at `depth` (parents = processed-node indices, -1 = the root). → (hidden (S,H), logits (S,Vd))."""
        state = self.state
        device = hidden.device
        s, prior, length = len(tokens), len(self.seen), state.length
        rows = [(self.seen[p] if p >= 0 else []) + [prior + i] for i, p in enumerate(parents)]
        allowed = torch.zeros(s, length + prior + s, dtype=torch.bool)
        allowed[:, :length] = True
        for i, row in enumerate(rows):
            allowed[i, [length + j for j in row]] = True
        allowed = allowed.to(device)
        positions = torch.full((1, s), length - 1 + depth, device=device)

        def attend(q, k, v):
            cache_k = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            cache_v = v if self.values is None else torch.cat([self.values, v], dim=2)
            self.keys, self.values = cache_k, cache_v
            return state._attend(q, cache_k, cache_v, allowed)

        ids = torch.tensor([tokens], device=device)
        out_hidden, logits = state.drafter.step(ids, hidden[None], positions, attend)
        self.seen.extend(rows)
        return out_hidden[0], logits[0]


@torch.no_grad()
def draft_chain(state: DraftState, root: Root, steps: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> DraftTree:
    """K tokens in a line: the drafter's argmax (T = 0) or a sample from softmax(logits / T) (T > 0)."""
    draft_round = _DraftRound(state)
    hidden, logits = root.hidden, root.logits
    tokens, proposals = [], []
    vocab = state.drafter.config.vocab_size
    for k in range(steps):
        if temperature > 0:
            q_draft = target_probs(logits, temperature)  # (Vd,)
            pick = int(torch.multinomial(q_draft, 1, generator=generator))
            q = torch.zeros(vocab, device=q_draft.device).index_copy_(0, state.target_ids, q_draft)  # (V,)
        else:
            pick, q = int(logits.argmax()), None
        tokens.append(int(state.target_ids[pick]))
        proposals.append(q)
        if k + 1 < steps:
            out_hidden, out_logits = draft_round.step(tokens[-1:], hidden[None], depth=k + 1, parents=[k - 1])
            hidden, logits = out_hidden[0], out_logits[0]
    return DraftTree(tokens=tokens, parents=list(range(-1, steps - 1)), proposals=proposals)


@torch.no_grad()
def draft_tree(state: DraftState, root: Root, depth: int, topk: int, nodes: int,
               temperature: float = 0.0) -> DraftTree:
    """EAGLE-2 dynamic tree: expand the top-k frontier by cumulative log-prob per depth, keep the best `nodes`.

    Depth 1 is the root's top-k. At each further depth the k frontier nodes run one batched drafter step, each
    proposes its top-k children (k² candidates, scored parent + log q), and the k best candidates become the next
    frontier. Finally every scored candidate competes for the `nodes` slots (`rerank`). Children are
    deterministic picks, so T > 0 only sharpens or flattens the scores (see sampling.choose_child)."""
    scale = temperature if temperature > 0 else 1.0
    draft_round = _DraftRound(state)
    logp = torch.log_softmax(root.logits.float() / scale, dim=-1)  # (Vd,)
    top = logp.topk(min(topk, logp.numel()))
    tokens = state.target_ids[top.indices].tolist()
    scores = top.values.tolist()
    parents = [-1] * len(tokens)
    frontier = list(range(len(tokens)))  # candidate indices to expand next
    frontier_hidden = root.hidden[None].expand(len(frontier), -1)  # (k, H) each node's input hidden
    processed: dict[int, int] = {}  # candidate index → processed-node index in the round
    for d in range(1, depth):
        proc_parents = [processed.get(parents[c], -1) for c in frontier]
        out_hidden, logits = draft_round.step([tokens[c] for c in frontier], frontier_hidden, d, proc_parents)
        for c in frontier:
            processed[c] = len(processed)
        logp = torch.log_softmax(logits.float() / scale, dim=-1)  # (k, Vd)
        top = logp.topk(min(topk, logp.shape[-1]), dim=-1)  # (k, k)
        base = torch.tensor([scores[c] for c in frontier], device=logp.device)[:, None]
        cand_scores = (base + top.values).flatten()  # (k*k,)
        first = len(tokens)
        tokens += state.target_ids[top.indices.flatten()].tolist()
        scores += cand_scores.tolist()
        parents += [c for c in frontier for _ in range(top.indices.shape[1])]
        best = cand_scores.topk(min(topk, cand_scores.numel())).indices  # (k,)
        frontier = [first + int(i) for i in best]
        frontier_hidden = out_hidden[best // top.indices.shape[1]]  # (k, H) parent's output
    return rerank(tokens, parents, scores, nodes)
