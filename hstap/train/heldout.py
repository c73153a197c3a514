"""Held-out evaluation while training: loss, top-1 accuracy per TTT step, and estimated acceptance length."""

from __future__ import annotations

import torch

from hstap.train.data import BatchSource, SampleSource, load_batch, plan_batches
from hstap.train.ttt import autocast, estimated_tau, ttt_forward


@torch.no_grad()
def evaluate_heldout(drafter, source: SampleSource | BatchSource, indices: list[int], layer_ids: list[int],
                     t2d_ids: torch.Tensor, cfg, device: torch.device) -> dict:
    """Teacher-forced TTT unroll over the held-out split (no grad).

    Returns {"loss", "acc": [per step], "tau_est": {chain length d: τ}, "positions"}; τ for a greedy chain of d
    drafts is 1 + mean(min(accepted run, d)) — see `estimated_tau`."""
    if not indices:
        return {}
    was_training = drafter.training
    drafter.eval()
    steps = cfg.ttt_steps
    loss_sum, weight_sum = 0.0, 0.0
    correct, counted = [0] * steps, [0] * steps
    runs, oks = [], []
    for batch_idx in plan_batches(indices, source.lengths, cfg.batch_tokens, seed=0, epoch=0):
        batch = load_batch(source, batch_idx, layer_ids, device)
        with autocast(device):
            out = ttt_forward(drafter, batch, t2d_ids, steps, cfg.decay)
        weights = [cfg.decay ** k for k in range(steps)]
        losses, hits, positions = out.stats.tolist()  # one read-back per batch
        loss_sum += sum(w * l * n for w, l, n in zip(weights, losses, positions))
        weight_sum += sum(w * n for w, n in zip(weights, positions))
        correct = [a + int(b) for a, b in zip(correct, hits)]
        counted = [a + int(b) for a, b in zip(counted, positions)]
        runs.append(out.run_lengths.flatten().cpu())
        oks.append(out.run_valid.flatten().cpu())
    drafter.train(was_training)
    run_len, run_ok = torch.cat(runs), torch.cat(oks)
    tau = {d: estimated_tau(run_len, run_ok, d)[0] for d in range(1, steps + 1)}
    return {
        "loss": loss_sum / max(weight_sum, 1e-9) * sum(cfg.decay ** k for k in range(steps)),
        "acc": [c / n if n else float("nan") for c, n in zip(correct, counted)],
        "tau_est": tau,
        "positions": counted[0],
    }
