"""Decoding loops with the embedded (transformers) target: vanilla, and speculative with chain or tree drafts.

Both run batch 1 over a `DynamicCache`, so they share the backend that the speedup is measured against. The
speculative loop keeps one invariant: the target's cache holds every committed token but the newest (the root);
each iteration drafts a tree below the root, verifies [root, tree] in one target forward (tree mask, depth-based
positions), accepts a path plus one bonus token, and gathers the path's KV entries into place.

    gen = vanilla_generate(model, prompt_ids, max_new_tokens=64, stop_ids={2})
    gen = speculative_generate(model, drafter, prompt_ids, DraftShape.parse("tree:8,8,60"), 64, {2})
    gen.tokens, gen.tau, gen.accepted

τ counts what verification forwards produce: the first new token comes from the prefill forward and counts in
neither the tokens nor the forwards (so vanilla decoding has τ = 1 and a chain of K has τ ≤ K + 1). Tokens past a
stop token or max_new_tokens are dropped, and not counted, even when the target accepted them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from hstap.capture.hf import decoder_layers
from hstap.capture.hooks import first_tensor
from hstap.drafter import Eagle3Drafter
from hstap.evaluate import drafting  # the module: tests patch it
from hstap.evaluate.sampling import choose_child, sample, target_probs
from hstap.evaluate.shapes import DraftShape
from hstap.evaluate.tree import DraftTree, verify_mask
from hstap.metrics import acceptance_length


@dataclass
class Generation:
    """One answer and how it was produced. Per verification forward: draft tokens accepted (before any cut at
    a stop or max_new_tokens), tokens kept (accepted + bonus, after the cut) and draft tokens proposed."""

    tokens: list[int]
    seconds: float
    verify_forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per verification forward, bonus included (NaN when the prefill produced everything)."""
        if self.verify_forwards == 0:
            return float("nan")
        return acceptance_length(sum(self.emitted), self.verify_forwards)


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Next token from (V,) logits: argmax at T = 0, else a sample from softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature), generator)


def _extend(out: list[int], new: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[int, bool]:
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


@torch.no_grad()
def vanilla_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                     temperature: float = 0.0, generator: torch.Generator | None = None) -> Generation:
    """Plain autoregressive decoding: prefill, then one target forward per token."""
    device = model.device
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache,
                   use_cache=True).logits[0, -1]
    tokens: list[int] = []
    gen = Generation(tokens=tokens, seconds=0.0)
    _, done = _extend(tokens, [pick(logits, temperature, generator)], stop_ids, max_new_tokens)
    while not done:
        logits = model(input_ids=torch.tensor([tokens[-1:]], device=device), past_key_values=cache,
                       use_cache=True).logits[0, -1]
        kept, done = _extend(tokens, [pick(logits, temperature, generator)], stop_ids, max_new_tokens)
        gen.verify_forwards += 1
        gen.accepted.append(0)
        gen.emitted.append(kept)
        gen.drafted.append(0)
    gen.seconds = time.perf_counter() - start
    return gen


@contextmanager
def aux_hooks(model: torch.nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks keeping the latest output of decoder layer k (hstap layer k) for k in `layer_ids`."""
    seen: dict[int, torch.Tensor] = {}
    layers = decoder_layers(model)

    def hook_for(k: int):
        def hook(module, args, output) -> None:
            seen[k] = first_tensor(output)  # (1, S, H)
        return hook

    handles = [layers[k].register_forward_hook(hook_for(k)) for k in sorted(set(layer_ids))]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _aux(seen: dict[int, torch.Tensor], layer_ids: list[int], rows: torch.Tensor | None = None) -> torch.Tensor:
    """(1, S, n_aux*H) in the drafter's layer order, optionally only the given sequence rows."""
    aux = torch.cat([seen[k] for k in layer_ids], dim=-1)
    return aux if rows is None else aux[:, rows]


def keep_cache(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only sequence positions `keep` (ascending) of every layer's keys and values, in that order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, keep)  # (1, nkv, len(keep), hd)
        layer.values = layer.values.index_select(2, keep)


def verify(model: torch.nn.Module, cache: DynamicCache, root: int, tree: DraftTree) -> torch.Tensor:
    """One target forward over [root, tree nodes]; → logits (1+N, V). The cache grows by 1+N entries."""
    device = model.device
    prefix = cache.get_seq_length()
    ids = torch.tensor([[root, *tree.tokens]], device=device)
    positions = torch.tensor([[0, *tree.depths]], device=device) + prefix
    mask = verify_mask(tree.parents, prefix, model.dtype, device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
    return out.logits[0]


def accept(logits: torch.Tensor, tree: DraftTree, temperature: float,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """Walk down the tree from the root: → (accepted node indices, bonus token).

    T = 0: follow the child equal to the target's argmax; the bonus is the argmax where no child matches.
    T > 0: recursive rejection sampling over each node's children (sampling.choose_child)."""
    path: list[int] = []
    node, row = -1, 0
    greedy = logits.argmax(-1).tolist() if temperature <= 0 else None  # (1+N,)
    while True:
        kids = tree.children(node)
        if greedy is not None:
            nxt = next((c for c in kids if tree.tokens[c] == greedy[row]), None)
            if nxt is None:
                return path, greedy[row]
        else:
            p = target_probs(logits[row], temperature)  # (V,)
            index, rest = choose_child(p, [tree.tokens[c] for c in kids], [tree.proposals[c] for c in kids],
                                       generator)
            if index is None:
                return path, sample(rest, generator)
            nxt = kids[index]
        path.append(nxt)
        node, row = nxt, nxt + 1


def propose(state: drafting.DraftState, root: drafting.Root, shape: DraftShape, temperature: float,
            generator: torch.Generator | None) -> DraftTree:
    """The draft for one verification (module-level so tests can substitute an oracle)."""
    if shape.kind == "chain":
        return drafting.draft_chain(state, root, shape.depth, temperature, generator)
    return drafting.draft_tree(state, root, shape.depth, shape.topk, shape.nodes, temperature)


@torch.no_grad()
def speculative_generate(model: torch.nn.Module, drafter: Eagle3Drafter, prompt_ids: list[int], shape: DraftShape,
                         max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> Generation:
    """EAGLE-3 speculative decoding; greedy (T = 0) output equals `vanilla_generate`'s token for token."""
    device = model.device
    layer_ids = drafter.config.aux_layer_ids
    start = time.perf_counter()
    with aux_hooks(model, layer_ids) as seen:
        cache = DynamicCache(config=model.config)
        prompt = torch.tensor([prompt_ids], device=device)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1]
        tokens: list[int] = []
        gen = Generation(tokens=tokens, seconds=0.0)
        _, done = _extend(tokens, [pick(logits, temperature, generator)], stop_ids, max_new_tokens)
        state = drafting.DraftState(drafter)
        if not done:
            next_ids = torch.tensor([prompt_ids[1:] + tokens], device=device)  # token t+1 for every prompt position t
            root = state.extend(_aux(seen, layer_ids), next_ids)
        while not done:
            prefix = cache.get_seq_length()
            tree = propose(state, root, shape, temperature, generator)
            logits = verify(model, cache, tokens[-1], tree)  # (1+N, V)
            path, bonus = accept(logits, tree, temperature, generator)
            rows = torch.tensor([0] + [1 + i for i in path], device=device)  # root + accepted nodes
            keep_cache(cache, torch.cat([torch.arange(prefix, device=device), prefix + rows]))
            new = [tree.tokens[i] for i in path] + [bonus]
            kept, done = _extend(tokens, new, stop_ids, max_new_tokens)
            gen.verify_forwards += 1
            gen.accepted.append(len(path))
            gen.emitted.append(kept)
            gen.drafted.append(len(tree))
            if not done:
                root = state.extend(_aux(seen, layer_ids, rows), torch.tensor([new], device=device))
    gen.seconds = time.perf_counter() - start
    return gen
