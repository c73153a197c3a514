"""Held-out evaluation while training: loss, top-1 accuracy per TTT step, and estimated acceptance length."""

from __future__ import annotations

import math

import torch

from hstap.train.data import BatchSource, SampleSource, load_batch, plan_batches
from hstap.train.ttt import autocast, estimated_tau, simulated_tau, ttt_forward


@torch.no_grad()
def evaluate_heldout(drafter, source: SampleSource | BatchSource, indices: list[int], layer_ids: list[int],
                     t2d_ids: torch.Tensor, cfg, device: torch.device) -> dict:
    """Teacher-forced TTT unroll over the held-out split (no grad).

    Returns {"loss", "acc": [per step], "tau_est": {chain length d: τ}, "tau_per_position": {d: τ},
    "positions"}: `tau_est` replays greedy chain decoding along each answer (`simulated_tau`, the figure to plan
    with); `tau_per_position` is 1 + mean(min(accepted run, d)) over all positions (`estimated_tau`), which
    overstates τ because decoding skips the easy positions it accepts."""
    if not indices:
        return {}
    was_training = drafter.training
    drafter.eval()
    steps = cfg.ttt_steps
    loss_sum, weight_sum = 0.0, 0.0
    correct, counted = [0] * steps, [0] * steps
    runs, oks, sims = [], [], {d: [0.0, 0] for d in range(1, steps + 1)}
    for batch_idx in plan_batches(indices, source.lengths, cfg.batch_tokens, seed=0, epoch=0):
        batch = load_batch(source, batch_idx, layer_ids, device)
        with autocast(device):
            out = ttt_forward(drafter, batch, t2d_ids, steps, cfg.decay, cfg.ttt_attention)
        weights = [cfg.decay ** k for k in range(steps)]
        losses, hits, positions = out.stats.tolist()  # one read-back per batch
        loss_sum += sum(w * l * n for w, l, n in zip(weights, losses, positions))
        weight_sum += sum(w * n for w, n in zip(weights, positions))
        correct = [a + int(b) for a, b in zip(correct, hits)]
        counted = [a + int(b) for a, b in zip(counted, positions)]
        run_lengths = out.run_lengths.cpu()  # (B, S), read back once for every chain length below
        runs.append(run_lengths.flatten())
        oks.append(out.run_valid.flatten().cpu())
        answer = (batch.loss_mask & batch.valid).cpu()
        for d in sims:  # τ·cycles adds up over batches: keep the sums
            tau_d, cycles = simulated_tau(run_lengths, answer, d)
            if cycles:
                sims[d][0] += tau_d * cycles
                sims[d][1] += cycles
    drafter.train(was_training)
    run_len, run_ok = torch.cat(runs), torch.cat(oks)
    per_position = {d: estimated_tau(run_len, run_ok, d)[0] for d in range(1, steps + 1)}
    tau = {d: (total / cycles if cycles else float("nan")) for d, (total, cycles) in sims.items()}
    return {
        "loss": loss_sum / max(weight_sum, 1e-9) * sum(cfg.decay ** k for k in range(steps)),
        "acc": [c / n if n else float("nan") for c, n in zip(correct, counted)],
        "tau_est": tau,
        "tau_per_position": per_position,
        "positions": counted[0],
    }


def first_answers(answer: torch.Tensor) -> torch.Tensor:
    """(B, S) bool answer tokens → each row's first answer segment only (its first turn's answer)."""
    a = answer.long()
    starts = torch.cat([a[:, :1], (a[:, 1:] - a[:, :-1]).clamp_min(0)], dim=1)  # (B, S) 1 where a segment starts
    return answer & (starts.cumsum(1) == 1)


@torch.no_grad()
def replayed_first_answers(drafter, source: SampleSource | BatchSource, indices: list[int], layer_ids: list[int],
                           t2d_ids: torch.Tensor, cfg, device: torch.device, chain: int,
                           max_new_tokens: int) -> float:
    """The held-out estimate on exactly what calibration decodes: these samples' first answers, each cut where a
    decode of `max_new_tokens` stops (`simulated_tau`), as one batch. NaN without samples."""
    if not indices:
        return math.nan
    was_training = drafter.training
    drafter.eval()
    batch = load_batch(source, indices, layer_ids, device)
    with autocast(device):
        out = ttt_forward(drafter, batch, t2d_ids, cfg.ttt_steps, cfg.decay, cfg.ttt_attention)
    drafter.train(was_training)
    answer = first_answers((batch.loss_mask & batch.valid).cpu())
    return simulated_tau(out.run_lengths.cpu(), answer, chain, max_new_tokens)[0]
