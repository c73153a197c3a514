"""Speculative decoding on the runtime: a batch of rows, chain / tree / n-gram drafts, greedy or sampled.

Each row keeps one invariant: its target cache holds every committed token but the newest (the root). A cycle
drafts a block below each root (proposals.py), verifies [root, block] in one target forward with the block's tree
mask and depth-based positions, accepts a path plus one bonus token per row (accept.py), gathers the path's
keys and values into place inside the cache, and hands the accepted rows' hidden states to the drafter, whose
cache takes them at the start of the next cycle. Greedy cycles run on the device from end to end — two CUDA
graphs per shape (drafting; verification + acceptance + commit) — and the host reads one small tensor per cycle
(accepted counts and tokens), after launching the next cycle. Sampled cycles (T > 0) accept row by row on the
host with the speculative-sampling rule, eagerly.

    dec = SpecDecoder(runtime, DraftShape.parse("tree:8,8,60"), drafter)
    rows = dec.generate(prompts, max_new_tokens=256, stop_ids={2}, pad_id=2)
    rows[0].tokens, rows[0].accepted, rows[0].emitted

Tokens past a stop token or max_new_tokens are dropped and not counted, even when the target accepted them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from hstap.drafter import Eagle3Drafter
from hstap.runtime.accept import greedy_accept, sampled_accept
from hstap.runtime.decode import left_pad
from hstap.runtime.proposals import Block, Drafts, draft_chain, draft_ngram, draft_tree, extend
from hstap.runtime.lean_drafter import LeanDrafter
from hstap.runtime.graphs import InCapture, StageClock, graph_body
from hstap.runtime.kv import ancestors, block_columns, with_root
from hstap.runtime.sampling import sample, target_probs
from hstap.runtime.shapes import DraftShape
from hstap.runtime.target import Runtime, Slot, pad_left


@dataclass
class SpecRow:
    """One answer (the stop token included when one ended it) and, per verification forward: draft tokens
    accepted (before any cut), tokens kept (accepted + bonus, after the cut) and draft tokens proposed."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    done: bool = False


def extend_tokens(out: list[int], new: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[int, bool]:
    """Append `new` up to a stop token or max_new_tokens; → (tokens kept, finished)."""
    kept = 0
    for tok in new:
        if len(out) >= max_new_tokens:
            return kept, True
        out.append(tok)
        kept += 1
        if tok in stop_ids:
            return kept, True
    return kept, len(out) >= max_new_tokens


@dataclass
class _State:
    """A decoder's static buffers in one slot: what its graphs read and write besides the target cache."""

    root: torch.Tensor  # (B,) newest committed token, not in the target cache yet
    history: torch.Tensor  # (B, L) token of every column, the root at write_at (prompt lookup reads it)
    block: Block  # (B, N) the draft below each root
    out: torch.Tensor  # (B, 2 + depth): accepted count, then path tokens + bonus
    drafts: Drafts | None = None
    pend_aux: torch.Tensor | None = None  # (B, 1 + depth, n·H) target layers of the rows committed last
    pend_tokens: torch.Tensor | None = None  # (B, 1 + depth) the token after each of them
    pend_count: torch.Tensor | None = None  # (B,) how many are real
    lookup: Block | None = None  # (B, N) prompt lookup's draft (hybrid shapes)


class SpecDecoder:
    """One draft shape on a `Runtime`. `propose(decoder, state, slot)`, when given, replaces the drafter's
    proposal (tests plant oracle drafts with it; eager only). `fused` (default: on CUDA, off for `@eager`
    shapes): the drafting graph's body runs compiled (`hstap.runtime.graphs.InCapture`)."""

    def __init__(self, runtime: Runtime, shape: DraftShape, drafter: Eagle3Drafter | None = None,
                 propose: Callable | None = None, fused: bool | None = None):
        if shape.uses_drafter and drafter is None:
            from hstap.errors import HstapError

            raise HstapError(f"draft shape {shape.spec} needs a drafter (ngram:K does not)")
        self.rt, self.shape, self.propose = runtime, shape, propose
        # graph bodies compiled (default: on CUDA), unless the shape asks for the plain kernels
        fused = (runtime.device.type == "cuda" if fused is None else fused) and not shape.eager
        self.lean = LeanDrafter(drafter, fused=fused) if shape.uses_drafter else None
        # the drafting graph's body compiled whole (the drafter's steps, the tree's top-k expansion and rerank,
        # prompt lookup: hundreds of small kernels eagerly); should that fail, its parts still compile alone
        self.drafting = InCapture(self._draft, fused and propose is None, "the fused drafting step")
        self.lookup = InCapture(draft_ngram, fused, "prompt lookup's fused draft")  # ~30 small kernels eagerly
        self.accepting = InCapture(self._accept_greedy, fused, "the fused acceptance")
        self.aux_layers = list(drafter.config.aux_layer_ids) if self.lean else []
        self.depth, self.nodes = shape.depth, shape.nodes
        self.reserve = self.reservation(shape)
        self.clock: StageClock | None = None
        # called with the rows after each verification's tokens reach the host (the hf server streams them); it
        # may mark a row done, and the batch stops waiting for that row
        self.on_cycle: Callable[[list[SpecRow]], None] | None = None
        # graphs and buffers are bound to one decoder: several decoders of a shape on one runtime get a number each
        self.tag = (shape.spec, runtime.decoders.get(shape.spec, 0))
        runtime.decoders[shape.spec] = self.tag[1] + 1

    @staticmethod
    def reservation(shape: DraftShape) -> int:
        """Cache columns past the answer a shape needs: a verification block or a drafting round beyond the
        committed tokens, after up to two cycles' acceptances past max_new_tokens (one cycle runs ahead)."""
        rounds = (shape.depth - 1) * shape.topk  # drafter step entries written past the committed tokens
        return 2 * (shape.depth + 1) + max(shape.nodes + 1, rounds) + 2

    # ---- the host loop ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int,
                 temperature: float | list[float] = 0.0, top_p: float | list[float] = 1.0,
                 generator: torch.Generator | None = None) -> list[SpecRow]:
        """Decode the prompts as one batch (at most the runtime's batch size); greedy rows reproduce vanilla
        greedy decoding token for token (up to the rounding of the dtype)."""
        rows = len(prompts)
        temps = temperature if isinstance(temperature, list) else [temperature] * rows
        top_ps = top_p if isinstance(top_p, list) else [top_p] * rows
        ids, mask = left_pad(prompts, pad_id, self.rt.device)
        # padded here to the width the runtime prefills at (a graph's bucket): the history and the drafter's
        # step-0 entries below are laid out by these columns, which must be the cache's (write_at = that width)
        ids, mask = pad_left(ids, mask, self.rt.prefill_width(ids.shape[1], max_new_tokens, self.reserve), pad_id)
        if self.clock:
            self.clock.start()
        out = self.rt.prefill(ids, mask, max_new_tokens, self.reserve, self.aux_layers)
        logits, aux = out if self.aux_layers else (out, None)
        first = [int(logits[b].argmax()) if temps[b] <= 0 else
                 sample(target_probs(logits[b], temps[b], top_ps[b]), generator) for b in range(rows)]
        results = [SpecRow(tokens=[]) for _ in range(rows)]
        for row, tok in zip(results, first):
            _, row.done = extend_tokens(row.tokens, [tok], stop_ids, max_new_tokens)
        slot = self.rt.slot
        st = self._state(slot)
        self._start(st, slot, ids, torch.tensor(first, device=ids.device), aux)
        if self.clock:
            self.clock.lap("prefill")  # the prompts' forward, the first token, the drafter's step-0 entries
        if all(r.done for r in results):
            return results
        if all(t <= 0 for t in temps):
            self._greedy_loop(st, slot, results, max_new_tokens, stop_ids)
        else:
            while not all(r.done for r in results):
                self._sampled_cycle(st, slot, results, temps, top_ps, generator)
                self._absorb(st.out.tolist(), results, max_new_tokens, stop_ids)
        return results

    def _greedy_loop(self, st: _State, slot: Slot, results: list[SpecRow], max_new: int, stops: set[int]) -> None:
        """Launch cycle i+1 before reading cycle i's answer, so the device never waits for the host (a row that
        finished meanwhile runs one cycle for nothing, within the reserved columns)."""
        cuda = self.rt.device.type == "cuda"
        host = [torch.empty(st.out.shape, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        events: list[torch.cuda.Event | None] = [None, None]
        draft = self.rt.graph(("draft", self.tag), lambda: self._captured_draft(st, slot), self._saved(st, slot))
        verify = self.rt.graph(("verify", self.tag), lambda: self._verify_greedy(st, slot), self._saved(st, slot))

        def launch(i: int) -> None:
            slot.bound += self.depth + 1  # the most a cycle advances a row
            if self.clock:  # since the previous cycle's (or the prefill's) last mark: the device waiting on the host
                self.clock.lap("between")
            draft()
            if self.clock:
                self.clock.lap("draft")
            verify()
            if self.clock:
                self.clock.lap("verify")
            host[i % 2].copy_(st.out, non_blocking=cuda)
            if cuda:
                events[i % 2] = torch.cuda.Event()
                events[i % 2].record()

        launch(0)
        i = 0
        while True:
            ahead = any(not r.done and max_new - len(r.tokens) > self.depth + 1 for r in results)
            if ahead:
                launch(i + 1)
            if cuda:
                events[i % 2].synchronize()
            self._absorb(host[i % 2].tolist(), results, max_new, stops)
            if all(r.done for r in results):
                return
            if not ahead:
                launch(i + 1)
            i += 1

    def _captured_draft(self, st: _State, slot: Slot) -> None:
        """The drafting graph's body, compiled whole (its parts alone if that compile failed)."""
        with graph_body():
            self.drafting(st, slot)

    def _absorb(self, packed: list[list[int]], results: list[SpecRow], max_new: int, stops: set[int]) -> None:
        for row, values in zip(results, packed):
            if row.done:
                continue
            count = values[0]
            kept, row.done = extend_tokens(row.tokens, values[1: 2 + count], stops, max_new)
            row.accepted.append(count)
            row.emitted.append(kept)
            row.drafted.append(self.nodes)
        if self.on_cycle is not None:
            self.on_cycle(results)

    # ---- state --------------------------------------------------------------------------------------------

    def _state(self, slot: Slot) -> _State:
        key = ("spec", self.tag)
        if key not in slot.buffers:
            slot.buffers[key] = self._allocate(slot)
        return slot.buffers[key]

    def _allocate(self, slot: Slot) -> _State:
        b, device, d = slot.batch, self.rt.device, self.depth
        long = dict(dtype=torch.long, device=device)
        block = Block.chain(b, self.nodes, device) if self.shape.kind != "tree" else Block(
            *(torch.zeros(b, self.nodes, **long) for _ in range(3)))
        st = _State(root=torch.zeros(b, **long), history=torch.zeros(b, slot.length, **long), block=block,
                    out=torch.zeros(b, 2 + d, **long))
        if self.lean is not None:
            lean = self.lean
            block.q = torch.zeros(b, self.nodes, lean.draft_vocab, device=device)
            st.drafts = Drafts(kv=lean.new_cache(b, slot.length),
                               hidden=torch.zeros(b, lean.hidden_size, dtype=lean.dtype, device=device),
                               logits=torch.zeros(b, lean.draft_vocab, dtype=lean.dtype, device=device))
            st.pend_aux = torch.zeros(b, 1 + d, lean.fc.shape[1], dtype=lean.dtype, device=device)
            st.pend_tokens = torch.zeros(b, 1 + d, **long)
            st.pend_count = torch.zeros(b, **long)
        if self.shape.kind == "hybrid":
            st.lookup = Block.chain(b, self.nodes, device)
        return st

    def _saved(self, st: _State, slot: Slot) -> list[torch.Tensor]:
        """What a graph's warm-up run changes that the real cycle must find as it was."""
        saved = [slot.write_at, st.root]
        if st.drafts is not None:
            saved += [st.pend_count, st.drafts.hidden, st.drafts.logits]
        return saved

    def _start(self, st: _State, slot: Slot, ids: torch.Tensor, first: torch.Tensor, aux: torch.Tensor | None):
        """After prefill: the roots, the token history, and the drafter's step-0 entries of every prompt token."""
        rows, width = ids.shape
        st.history.zero_()
        st.history[:rows, :width] = ids
        st.history[:rows, width] = first
        st.root.zero_()
        st.root[:rows] = first
        if st.drafts is None:
            return
        st.pend_count.zero_()
        # the prefill replayed a graph of this width: the drafter's part replays one too (eagerly its launches
        # made a GPU prompt's prefill twice prompt lookup's, enough to hold chain:3's speedup well under its τ);
        # its inputs then live in static buffers, kept per width
        graphed = slot.graph_width == width
        key = ("start", self.tag, width)
        inputs = slot.buffers.get(key) if graphed else None
        if inputs is None:  # the token after each position (B, W), the aux states (B, W, n·H), each row's count
            inputs = (torch.empty(slot.batch, width, dtype=torch.long, device=ids.device),
                      aux.new_empty(slot.batch, *aux.shape[1:]),
                      torch.full((slot.batch,), width, dtype=torch.long, device=ids.device))
            if graphed:
                slot.buffers[key] = inputs
        tokens, full, count = inputs
        tokens.zero_()
        tokens[:rows] = torch.cat([ids[:, 1:], first[:, None]], dim=1)  # the token after every prompt position
        full.zero_()
        full[:rows] = aux

        def body() -> None:
            extend(self.lean, st.drafts, slot, full, tokens, count, padded_start=True)

        if graphed:
            self.rt.graph(key, body, [st.drafts.hidden, st.drafts.logits])()
        else:
            body()

    # ---- one cycle ----------------------------------------------------------------------------------------

    def _draft(self, st: _State, slot: Slot, temps: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> None:
        """Hand the last commit to the drafter, then fill st.block (capturable when temps is None)."""
        if st.drafts is not None:
            extend(self.lean, st.drafts, slot, st.pend_aux, st.pend_tokens, st.pend_count)
        kind = self.shape.kind
        if self.propose is not None:
            self.propose(self, st, slot)
        elif kind == "ngram":
            self.lookup(st.history, slot, st.block, self.shape.match)
        elif kind == "chain":
            draft_chain(self.lean, st.drafts, slot, st.block, temps, generator)
        elif kind == "hybrid":  # both drafts on the device, a per-row choice: no host sync, graph-capturable
            draft_chain(self.lean, st.drafts, slot, st.block, temps, generator)
            copying = self.lookup(st.history, slot, st.lookup, self.shape.match) >= self.shape.match  # (B,)
            st.block.tokens.copy_(torch.where(copying[:, None], st.lookup.tokens, st.block.tokens))
        else:
            scale = None if temps is None else temps.clamp_min(1e-5).where(temps > 0, 1.0)[:, None]
            draft_tree(self.lean, st.drafts, slot, st.block, self.depth, self.shape.topk, scale)

    def _verify(self, st: _State, slot: Slot) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward over [root, block] → logits (B, 1+N, V), aux (B, 1+N, n·H) | None."""
        block = st.block
        tokens = torch.cat([st.root[:, None], block.tokens], dim=1)  # (B, 1+N)
        depths = torch.cat([torch.zeros_like(block.depths[:, :1]), block.depths], dim=1)  # (B, 1+N)
        if self.shape.kind == "tree":
            tree = with_root(ancestors(block.parents, self.depth))  # (B, 1+N, 1+N)
        else:  # a chain: [root, 1..K] causal
            tree = torch.ones(self.nodes + 1, self.nodes + 1, dtype=torch.bool, device=tokens.device).tril()
        return self.rt.block(slot, tokens, depths, tree, self.aux_layers)

    def _verify_greedy(self, st: _State, slot: Slot) -> None:
        """The verification graph's body: the target's forward (its own kernels), then acceptance and the
        commit, compiled together inside graph bodies (~30 small kernels eagerly)."""
        logits, aux = self._verify(st, slot)
        with graph_body():
            self.accepting(st, slot, logits, aux)

    def _accept_greedy(self, st: _State, slot: Slot, logits: torch.Tensor, aux: torch.Tensor | None) -> None:
        count, path, bonus = greedy_accept(st.block.tokens, st.block.parents, self.depth, logits.argmax(-1))
        self._commit(st, slot, count, path, bonus, aux)

    def _commit(self, st: _State, slot: Slot, count: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor,
                aux: torch.Tensor | None) -> None:
        """Keep root + path in the target cache, advance every row, queue the rows for the drafter, pack the
        answer: count (B,), path (B, depth) accepted node indices (root first, padded), bonus (B,)."""
        rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # (B, 1+depth) block rows kept
        if self.shape.kind == "tree":  # a chain's accepted nodes are already its first rows
            slot.kv.commit(slot.write_at, rows)
        emitted = torch.cat([st.block.tokens.gather(1, path), torch.zeros_like(bonus[:, None])], dim=1)
        emitted.scatter_(1, count[:, None], bonus[:, None])  # (B, 1+depth): path tokens, bonus, garbage
        st.history.scatter_(1, block_columns(slot.write_at + 1, emitted.shape[1], slot.length), emitted)
        if st.drafts is not None:
            st.pend_aux.copy_(aux.gather(1, rows[:, :, None].expand(-1, -1, aux.shape[-1])))
            st.pend_tokens.copy_(emitted)
            st.pend_count.copy_(count + 1)
        slot.write_at.add_(count + 1)
        st.root.copy_(bonus)
        st.out[:, 0] = count
        st.out[:, 1:] = emitted

    def _sampled_cycle(self, st: _State, slot: Slot, results: list[SpecRow], temps: list[float],
                       top_ps: list[float], generator: torch.Generator | None) -> None:
        """One eager cycle with the acceptance rule run row by row on the host."""
        device = self.rt.device
        temp = torch.zeros(slot.batch, device=device)
        temp[: len(temps)] = torch.tensor(temps, device=device)
        if self.clock:
            self.clock.start()
        self._draft(st, slot, temp, generator)
        if self.clock:
            self.clock.lap("draft")
        logits, aux = self._verify(st, slot)
        block = st.block
        tokens, parents = block.tokens.tolist(), block.parents.tolist()
        count = torch.zeros(slot.batch, dtype=torch.long)
        path = torch.zeros(slot.batch, self.depth, dtype=torch.long)
        bonus = torch.zeros(slot.batch, dtype=torch.long)
        for b, row in enumerate(results):
            if row.done:
                continue
            proposals = [self._proposal(block, b, i) if temps[b] > 0 and self.shape.kind == "chain" else None
                         for i in range(self.nodes)]
            nodes, bonus[b] = sampled_accept(logits[b], tokens[b], parents[b], proposals, temps[b], top_ps[b],
                                             generator)
            count[b] = len(nodes)
            path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        self._commit(st, slot, count.to(device), path.to(device), bonus.to(device), aux)
        slot.bound += self.depth + 1
        if self.clock:
            self.clock.lap("verify")

    def _proposal(self, block: Block, b: int, i: int) -> torch.Tensor:
        """Node i's draft distribution over the target vocabulary (zero outside the draft vocabulary)."""
        q = block.q[b, i]  # (Vd,)
        return torch.zeros(self.rt.lean.vocab_size, device=q.device).index_copy_(0, self.lean.target_ids, q)
