"""Training plots from metrics.jsonl: loss (train + held-out), per-step accuracy, estimated τ."""

from __future__ import annotations

import json
from pathlib import Path

from hstap.plots import plt, save_figure


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and "loss" in r]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out")
    ax.set_xlabel("step"), ax.set_ylabel("TTT loss (weighted sum over steps)"), ax.legend()
    paths.append(save_figure(fig, Path(out_dir) / "loss.png"))

    if evals:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in (evals[0], evals[-1]) if len(evals) > 1 else evals[-1:]:
            ax.plot(range(len(r["acc"])), r["acc"], "o-", label=f"step {r['step']}")
        ax.set_xlabel("TTT step"), ax.set_ylabel("held-out top-1 accuracy"), ax.set_ylim(0, 1), ax.legend()
        paths.append(save_figure(fig, Path(out_dir) / "accuracy.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in (evals[0], evals[-1]) if len(evals) > 1 else evals[-1:]:
            tau = {int(k): v for k, v in r["tau_est"].items()}
            ax.plot(list(tau), list(tau.values()), "o-", label=f"step {r['step']}")
        ax.set_xlabel("chain draft length"), ax.set_ylabel("estimated τ"), ax.legend()
        paths.append(save_figure(fig, Path(out_dir) / "tau_estimate.png"))
    return paths
