"""Training-time test (TTT): unroll the drafter over K draft steps exactly as it will run at inference.

Step 0 at position t reads the target's hidden state h_t and the embedding of token t+1 and predicts token t+2.
Step k reads its own step-(k-1) output at t and token t+1+k, sits at rotary position t+k, and attends to the
step-0 keys of positions ≤ t plus its own chain's keys of steps 1..k at t — what a chain draft from t sees at
inference. Its teacher is the target's distribution at t+1+k (over token t+2+k), counted only where token t+2+k
is an assistant token (any token of the sample with `loss_on="all"`) and the target's argmax is in the draft
vocabulary. Step k's loss is weighted decay**k.

Memory per step stays linear in the sequence: attention runs a fused causal kernel over the step-0 keys and merges
the diagonal keys by log-sum-exp (`hstap.train.attention`; no (B, nh, S, S) scores on CUDA), and `lm_head` is fused
with the loss a block of positions at a time (`hstap.train.loss`; no (B, S, Vd) logits kept for the backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from hstap.drafter.model import Eagle3Drafter
from hstap.train import shared
from hstap.train.attention import TTTAttention
from hstap.train.loss import compute_dtype, head_cast, head_soft_cross_entropy_steps


@dataclass
class TTTBatch:
    """A padded batch (right padding). Teacher = target top-k log-probs at every position."""

    aux: torch.Tensor  # (B, S, n_aux*H) concatenated captured layers, in config.aux_layer_ids order
    input_ids: torch.Tensor  # (B, S) long
    loss_mask: torch.Tensor  # (B, S) bool — assistant tokens
    valid: torch.Tensor  # (B, S) bool — not padding
    topk_ids: torch.Tensor  # (B, S, K) long, target ids
    topk_logprobs: torch.Tensor  # (B, S, K) float

    def to(self, device: torch.device | str) -> "TTTBatch":
        return TTTBatch(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA, a no-op elsewhere: training steps and held-out evaluation run under the same one."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def empty_batch(b: int, s: int, width: int, aux_dtype: torch.dtype, k: int, pin: bool = False) -> TTTBatch:
    """An uninitialised (B, S) batch for `collate` to fill; `pin`: in pinned host memory, so its copy to a CUDA
    device runs asynchronously (the caller allocates it, on its own thread: pinned allocation is a CUDA call)."""
    return TTTBatch(aux=torch.empty(b, s, width, dtype=aux_dtype, pin_memory=pin),
                    input_ids=torch.empty(b, s, dtype=torch.long, pin_memory=pin),
                    loss_mask=torch.empty(b, s, dtype=torch.bool, pin_memory=pin),
                    valid=torch.empty(b, s, dtype=torch.bool, pin_memory=pin),
                    topk_ids=torch.empty(b, s, k, dtype=torch.long, pin_memory=pin),
                    topk_logprobs=torch.empty(b, s, k, pin_memory=pin))


def collate(samples: list[dict], layer_ids: list[int], into: TTTBatch | None = None) -> TTTBatch:
    """Store-format samples (see hstap.store) → one right-padded TTTBatch (written into `into` if given: an
    `empty_batch` of exactly this shape). Padding: zero states and ids, False masks, teacher id 0 at -inf."""
    longest = max(s["input_ids"].numel() for s in samples)
    first = samples[0]
    hid = first["hidden"][layer_ids[0]].shape[-1]
    if into is None:
        into = empty_batch(len(samples), longest, len(layer_ids) * hid, first["hidden"][layer_ids[0]].dtype,
                           first["teacher"]["topk_ids"].shape[-1])
    aux, ids, mask, valid, topk_ids, topk_lp = (getattr(into, f) for f in TTTBatch.__dataclass_fields__)
    for row, s in enumerate(samples):
        n = s["input_ids"].numel()
        for j, layer in enumerate(layer_ids):  # straight into place: no concatenated copy per row
            aux[row, :n, j * hid:(j + 1) * hid] = s["hidden"][layer]
        ids[row, :n] = s["input_ids"]
        mask[row, :n] = s["loss_mask"]
        valid[row, :n] = True
        topk_ids[row, :n] = s["teacher"]["topk_ids"]
        topk_lp[row, :n] = s["teacher"]["topk_logprobs"]
        for t, fill in ((aux, 0), (ids, 0), (mask, False), (valid, False), (topk_ids, 0), (topk_lp, -float("inf"))):
            t[row, n:] = fill
    return into


def shift_windows(x: torch.Tensor, fill, most: int, embed: nn.Embedding | None = None,
                  dtype: torch.dtype | None = None) -> Callable[[int], torch.Tensor]:
    """`shift_left(x, n, fill)` for every n ≤ `most`, each a view of one padded copy of x: the TTT unroll reads its
    steps' shifted inputs this way, one copy per tensor instead of one per step. `embed`: token ids x → windows
    of their embeddings in `dtype`, looked up once for every window (instead of once per step)."""
    padded = torch.cat([x, torch.full_like(x[:, :1], fill).expand(-1, most, *x.shape[2:])], dim=1)
    if embed is not None:
        padded = embed(padded).to(dtype)  # (B, S + most, H)
    s = x.shape[1]
    return lambda n: padded[:, n: n + s]


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t] ← x[:, t+n], the tail filled with `fill`: (B, S, ...) → (B, S, ...)."""
    return shift_windows(x, fill, n)(n)


def soft_cross_entropy(logits: torch.Tensor, target_draft_ids: torch.Tensor, target_probs: torch.Tensor,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """THE drafter loss: −Σ p·log q against a sparse teacher, averaged over positions with weight 1.

    logits (B, S, Vd); target_draft_ids (B, S, K) draft ids (−1 = outside the draft vocab, ignored);
    target_probs (B, S, K) teacher probabilities renormalised over the draft vocab; weight (B, S) bool.
    Returns (mean loss, number of counted positions).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # (B, S, Vd)
    picked = logq.gather(-1, target_draft_ids.clamp_min(0))  # (B, S, K)
    per_pos = -(target_probs * picked).sum(-1)  # (B, S)
    count = weight.sum()
    loss = (per_pos * weight).sum() / count.clamp_min(1)
    return loss, count


def teacher_in_draft_vocab(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                           t2d_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map the teacher's top-k to draft ids and renormalise over those in the draft vocab.

    Returns (draft ids (B,S,K) with −1 outside, probs (B,S,K), argmax_in_vocab (B,S) bool)."""
    draft_ids = t2d_ids[topk_ids]  # (B, S, K)
    inside = draft_ids >= 0
    probs = torch.where(inside, topk_logprobs.float().exp(), torch.zeros((), device=topk_ids.device))
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return draft_ids, probs, inside[..., 0]


@dataclass
class TTTOutput:
    """Per-step numbers stay on the device in `stats` (no host sync inside the unroll, so the host can queue the
    backward and the next batch while the device works); the list properties read them back."""

    loss: torch.Tensor  # weighted sum over steps (scalar, with grad)
    stats: torch.Tensor  # (3, steps) float64: loss, top-1 agreements with the target's argmax, positions counted
    run_lengths: torch.Tensor  # (B, S) consecutive correct steps from step 0 (teacher-forced chain)
    run_valid: torch.Tensor  # (B, S) how many consecutive steps from 0 were countable

    @property
    def step_losses(self) -> list[float]:
        return self.stats[0].tolist()

    @property
    def step_correct(self) -> list[int]:
        return [int(x) for x in self.stats[1].tolist()]

    @property
    def step_counted(self) -> list[int]:
        return [int(x) for x in self.stats[2].tolist()]


def ttt_forward(drafter: Eagle3Drafter, batch: TTTBatch, t2d_ids: torch.Tensor, steps: int = 7,
                decay: float = 0.8, attention: str = "auto", loss_on: str = "answers") -> TTTOutput:
    """Unroll `steps` draft steps over the whole batch; see the module docstring for the alignment.
    `attention`: the TTTAttention backend (auto = a fused kernel on CUDA, materialised scores elsewhere).
    `loss_on`: "answers" counts the positions that predict an assistant token; "all" every position that
    predicts a token of the sample, prompts included (the drafter computes them anyway, and the teacher there is
    still the target's own distribution). Held-out evaluation always counts answers."""
    if loss_on not in ("answers", "all"):
        raise ValueError(f"loss_on={loss_on!r}: expected 'answers' or 'all'")
    counted = batch.loss_mask if loss_on == "answers" else batch.valid  # (B, S) tokens whose prediction counts
    cfg = drafter.config
    attend = TTTAttention(cfg.num_attention_heads, cfg.num_key_value_heads, attention)
    b, s = batch.input_ids.shape
    hidden = drafter.project(batch.aux)  # (B, S, H)
    # the teacher in draft ids, once per batch; step k reads it shifted by 1 + k (the target's distribution at
    # t+1+k). Shifted-in tail positions are never counted (their token t+2+k lies past the sequence), so their
    # fill only has to be harmless: no id, probability 0.
    teacher_ids, teacher_probs, teacher_inside = teacher_in_draft_vocab(batch.topk_ids, batch.topk_logprobs, t2d_ids)
    # every step's shifted inputs are windows of one padded copy (`shift_windows`), and its rotary tables a window of
    # one table over positions 0..S+steps: a view per step instead of a fill and a concatenation per tensor per
    # step (an 8B step at 2,048 positions is host-bound on a GPU: every operator call saved is a launch saved)
    most = steps + 1
    # the embeddings of tokens t+1+k, embeds_at(1 + k): one lookup of the padded ids for every step
    embeds_at = shift_windows(batch.input_ids, 0, most, drafter.embed_tokens, hidden.dtype)
    ids_at, probs_at = shift_windows(teacher_ids, -1, most), shift_windows(teacher_probs, 0.0, most)
    inside_at, counts_at = shift_windows(teacher_inside, False, most), shift_windows(counted & batch.valid, False, most)
    cos, sin = drafter.rotary(torch.arange(s + steps, device=hidden.device)[None], hidden.dtype)  # (1, S+steps, hd)
    # q/k/v and gate/up as two matmuls, o and down, their weights cast once for every step; their weight gradients
    # summed inside the matmuls (hstap.train.shared) unless that is switched off
    dtype = compute_dtype(hidden)
    mm = shared.accumulating_matmuls(drafter, dtype) if shared.ENABLED else drafter.matmuls(dtype)
    hiddens, draft_ids, probs, weights = [], [], [], []
    for k in range(steps):
        rope = (cos[:, k: k + s], sin[:, k: k + s])  # positions t + k
        hidden = drafter.layer_step(None, hidden, None, attend, rope=rope, mm=mm, embeds=embeds_at(1 + k))  # (B, S, H)
        hiddens.append(drafter.norm(hidden))
        draft_ids.append(ids_at(1 + k))  # (B, S, K)
        probs.append(probs_at(1 + k))  # (B, S, K)
        weights.append(counts_at(2 + k) & inside_at(1 + k) & batch.valid)  # token t+2+k counted, argmax inside
    # = Σ_k decay**k · soft_cross_entropy(lm_head(norm(hidden_k)), ...), every step's head in one call, a block of
    # positions at a time, with one cast of the head and one fp32 weight gradient for all steps (hstap.train.loss)
    total, losses, counts, predicted = head_soft_cross_entropy_steps(
        hiddens, drafter.lm_head.weight, draft_ids, probs, weights, [decay ** k for k in range(steps)],
        cast=head_cast(drafter.lm_head.weight, hidden))  # predicted (steps, B, S) draft ids
    with torch.no_grad():
        hits = [(predicted[k] == draft_ids[k][..., 0]) & weights[k] for k in range(steps)]
        hit_counts = torch.stack([hit.sum() for hit in hits]).double()
        stats = torch.stack([losses.double(), hit_counts, counts.double()])  # (3, steps)
    run_len, run_ok = _chain_runs(hits, weights)
    return TTTOutput(total, stats, run_len, run_ok)


def _chain_runs(hits: list[torch.Tensor], countable: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: steps accepted in a row from step 0, and steps countable in a row from step 0."""
    alive_hit = torch.ones_like(hits[0])
    alive_ok = torch.ones_like(countable[0])
    run_len = torch.zeros(hits[0].shape, dtype=torch.long, device=hits[0].device)
    run_ok = torch.zeros_like(run_len)
    for hit, ok in zip(hits, countable):
        alive_ok = alive_ok & ok
        alive_hit = alive_hit & hit & alive_ok
        run_len += alive_hit
        run_ok += alive_ok
    return run_len, run_ok


def estimated_tau(run_lengths: torch.Tensor, run_valid: torch.Tensor, draft_tokens: int) -> tuple[float, int]:
    """Estimated acceptance length of a greedy chain of `draft_tokens` drafts, from teacher-forced agreement.

    Over positions where all `draft_tokens` steps are countable: τ ≈ 1 + mean(min(run, draft_tokens)) (the bonus
    token included). Exact for greedy verification when the data are the target's own greedy answers.
    Returns (τ estimate, positions used)."""
    usable = run_valid >= draft_tokens
    n = int(usable.sum())
    if n == 0:
        return float("nan"), 0
    accepted = run_lengths.clamp(max=draft_tokens)[usable].float()
    return 1.0 + float(accepted.mean()), n


def simulated_tau(run_lengths: torch.Tensor, answer: torch.Tensor, draft_tokens: int,
                  max_new_tokens: int | None = None) -> tuple[float, int]:
    """Acceptance length of greedy chain decoding with `draft_tokens` drafts, replayed along each held-out answer.

    `estimated_tau` averages over every position, but decoding does not visit every position: a cycle that
    accepts a drafts jumps a + 1 tokens ahead, so easy stretches are crossed in few cycles and hard ones token by
    token. Replaying the jumps weights positions as decoding does; the per-position average counts an easy
    position as often as a hard one and so overstates τ (docs/benchmarks.md compares both with a measured τ).
    Each answer segment (a run of answer tokens, one per
    turn) starts as decoding does: its first token comes from the prefill; with token c the last one committed,
    a cycle is step 0 at position c − 1 (it predicts token c + 1). Exact for greedy decoding when the answers are
    the target's own greedy output and the drafter computes what it computed here.

    run_lengths (B, S): consecutive correct steps from step 0 (`TTTOutput.run_lengths`); answer (B, S) bool:
    answer tokens (loss mask and not padding). `max_new_tokens` cuts each answer where a run with that limit
    stops (the last cycle counts what it kept, as the runtime's τ does). Returns (τ, cycles)."""
    runs = run_lengths.clamp(max=draft_tokens).tolist()
    tokens = cycles = 0
    for row_runs, row_answer in zip(runs, answer.tolist()):
        s, p = len(row_answer), 0
        while p < s:
            if not row_answer[p]:
                p += 1
                continue
            q = p
            while q < s and row_answer[q]:
                q += 1  # one answer segment: tokens [p, q)
            c = max(p, 1)  # the last committed token (the prefill's)
            end = q - 1 if max_new_tokens is None else min(q - 1, p + max_new_tokens - 1)
            while c < end:
                produced = min(row_runs[c - 1] + 1, end - c)  # accepted drafts + the bonus, cut at the end
                tokens, cycles, c = tokens + produced, cycles + 1, c + produced
            p = q
    return (tokens / cycles if cycles else float("nan")), cycles


class TTTModel(nn.Module):
    """`ttt_forward` as a module, so DistributedDataParallel sees one forward per step; returns tensors only."""

    def __init__(self, drafter: Eagle3Drafter, t2d_ids: torch.Tensor, steps: int, decay: float,
                 attention: str = "auto", loss_on: str = "answers"):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("t2d_ids", t2d_ids, persistent=False)
        self.steps, self.decay, self.attention, self.loss_on = steps, decay, attention, loss_on

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = ttt_forward(self.drafter, TTTBatch(*tensors), self.t2d_ids, self.steps, self.decay, self.attention,
                          self.loss_on)
        return out.loss, out.stats, out.run_lengths, out.run_valid


def batch_tensors(batch: TTTBatch) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(batch, f) for f in batch.__dataclass_fields__)
