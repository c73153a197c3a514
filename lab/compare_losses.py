"""Two training runs' loss curves side by side: a plot and the numbers (e.g. 2 GPUs vs 1 GPU with --grad-accum 2).

    python lab/compare_losses.py runs/ddp2 runs/one --labels "2 GPUs" "1 GPU, grad-accum 2" --out loss.png

Reads each run's metrics.jsonl (train records: step, loss). Prints, over the steps both runs logged, the largest
and the mean relative difference of the logged losses and the last held-out evaluation of each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hstap.plots import plt, save_figure


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def last_eval(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("kind") == "eval" and "loss" in r]
    return evals[-1] if evals else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs=2)
    ap.add_argument("--labels", nargs=2, default=None)
    ap.add_argument("--out", type=Path, default=Path("loss_curves.png"))
    args = ap.parse_args()
    labels = args.labels or [str(r) for r in args.runs]
    curves = [losses(r) for r in args.runs]
    common = sorted(set(curves[0]) & set(curves[1]))
    if not common:
        raise SystemExit("the two runs share no logged step")
    rel = [abs(curves[0][s] - curves[1][s]) / abs(curves[1][s]) for s in common]
    fig, ax = plt.subplots(figsize=(7, 4))
    for curve, label in zip(curves, labels):
        ax.plot(list(curve), list(curve.values()), label=label, alpha=0.8)
    ax.set_xlabel("optimizer step"), ax.set_ylabel("TTT loss"), ax.legend()
    ax.set_title(f"max relative difference {max(rel):.2e} over {len(common)} steps")
    save_figure(fig, args.out)
    print(f"{len(common)} common steps: relative loss difference max {max(rel):.3e}, mean {statistics.mean(rel):.3e}")
    for run, label in zip(args.runs, labels):
        ev = last_eval(run)
        acc = ev.get("acc", [float("nan")])[0]
        print(f"{label}: final held-out loss {ev.get('loss', float('nan')):.4f}, step-0 top-1 {acc:.4f} "
              f"(step {ev.get('step')})")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
