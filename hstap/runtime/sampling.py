"""Speculative sampling: the acceptance rule that keeps the output distribution exactly the target's.

One rule covers chains and trees (recursive rejection sampling over siblings, as in SpecInfer):

    r ← p                                   the target's distribution at the parent
    for each child x with proposal q:       q = the draft distribution x was sampled from,
        accept x with probability             or a point mass on x when x was picked deterministically
            min(1, r(x) / q(x))
        else r ← normalize(max(0, r − q))
    none accepted: sample the bonus from r

With a single child sampled from q this is the standard speculative-sampling step (Leviathan et al., Chen et al.).
With point masses (EAGLE-2 top-k children) it reads: accept x with probability r(x), else zero r(x) and renormalise
— valid for any deterministic candidate set. Siblings sampled independently from their own q are valid too.

    p = target_probs(logits, temperature=0.7)
    index, residual = choose_child(p, [x], [q], generator)
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) in fp32, restricted to the top-p nucleus and renormalised when top_p < 1;
    (…, V) → (…, V). The nucleus keeps the tokens ranked above mass top_p (at least one), as `pick_next`."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # mass ranked above each token
    p = p.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return p / p.sum(-1, keepdim=True)


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from the distribution p (V,)."""
    return int(torch.multinomial(p, 1, generator=generator))


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, r − q)); r itself if nothing is left (only reachable through rounding)."""
    rest = (r - q).clamp_min(0)
    total = rest.sum()
    return rest / total if total > 0 else r


def choose_child(p: torch.Tensor, tokens: list[int], proposals: list[torch.Tensor | None],
                 generator: torch.Generator | None = None) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over sibling candidates.

    Args:
        p: (V,) target distribution at the parent.
        tokens: candidate token ids, in the order they are tried.
        proposals: per candidate, the (V,) distribution it was sampled from, or None for a deterministic pick.
    Returns:
        (index of the accepted candidate, the distribution it was tested against) or (None, the residual to
        sample the bonus token from).
    """
    r = p
    for i, (x, q) in enumerate(zip(tokens, proposals)):
        qx = 1.0 if q is None else float(q[x])
        u = float(torch.rand((), generator=generator, device=r.device))
        if u * qx < float(r[x]):  # u < r(x)/q(x): accepted with probability min(1, r(x)/q(x))
            return i, r
        if q is None:
            q = torch.zeros_like(r)
            q[x] = 1.0
        r = residual(r, q)
    return None, r
