"""Drafter quality against training tokens: MT-bench τ per decoding method, fitted as τ = a + b·log2(tokens).

Why this exists: issue 12 asks for "the curve that shows where it saturates". The measurements are spread over
docs/benchmarks.md (one GPU run per section); lab/logs/scaling.json gathers them, one row per drafter (80
MT-bench questions, 256 new tokens, greedy, bf16, batch 1, one H200; CPU-replayed τ left out). A user reads this
to plan a training budget: b is the τ one more doubling of the tokens buys, the goal rows say how many tokens the
fit needs to reach a τ, and the local slope (the last two drafters of the lineage) shows whether the curve is
flattening below the fit.

    python lab/scaling.py                                   # the shipped lineage, goals chain:3=3.0, tree:8,8,60=4.5
    python lab/scaling.py --goal tree:4,4,16=4.0 --plot docs/figs/scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

METHODS = ("ngram:3", "chain:3", "hybrid:4,2", "tree:4,4,16", "tree:8,8,60")
LOOKUP = "ngram:3"  # prompt lookup needs no drafter: its τ is the floor, not a curve
DEFAULT_GOALS = ("chain:3=3.0", "tree:8,8,60=4.5")


class Row(TypedDict):
    run: str
    date: str
    chain: str
    tokens_trained: float
    steps: int | None
    tau: dict[str, float]
    source: str


@dataclass(frozen=True)
class Fit:
    a: float  # τ at 1 token (log2 = 0): only the line's offset
    b: float  # τ gained per doubling of the tokens trained
    r2: float
    n: int


def load(path: Path) -> list[Row]:
    """The measured drafters, sorted by tokens trained."""
    rows: list[Row] = json.loads(Path(path).read_text())
    return sorted(rows, key=lambda r: r["tokens_trained"])


def fit(tokens: list[float], taus: list[float]) -> Fit:
    """Least squares of τ on log2(tokens); R² is nan when τ does not vary."""
    xs = [math.log2(t) for t in tokens]
    n = len(xs)
    mx, my = sum(xs) / n, sum(taus) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, taus)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in taus)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, taus))
    return Fit(a, b, 1 - ss_res / ss_tot if ss_tot > 0 else math.nan, n)


def tokens_for(f: Fit, tau: float) -> float:
    """Tokens the fit needs for τ (inf when the fit does not rise)."""
    return 2 ** ((tau - f.a) / f.b) if f.b > 0 else math.inf


def points(rows: list[Row], method: str) -> list[tuple[float, float]]:
    """(tokens trained, τ) of the rows that measured `method`, in the rows' order."""
    return [(r["tokens_trained"], r["tau"][method]) for r in rows if method in r["tau"]]


def fit_method(rows: list[Row], method: str) -> Fit | None:
    """The fit over the rows that measured this method; None below two distinct token counts."""
    pts = points(rows, method)
    if len({t for t, _ in pts}) < 2:
        return None
    return fit([t for t, _ in pts], [y for _, y in pts])


def local_slope(rows: list[Row], method: str) -> float | None:
    """τ per doubling between the last two rows that measured the method."""
    pts = points(rows, method)[-2:]
    if len(pts) < 2 or pts[0][0] == pts[1][0]:
        return None
    return (pts[1][1] - pts[0][1]) / math.log2(pts[1][0] / pts[0][0])


def fmt_tokens(t: float) -> str:
    if math.isinf(t):
        return "never"
    if t >= 1e12:
        return f"{t / 1e12:.1f} T"
    return f"{t / 1e9:.2f} B" if t >= 1e9 else f"{t / 1e6:.1f} M"


def table(rows: list[Row], lineage: str) -> str:
    """Markdown: one row per drafter, sorted by tokens; the lineage's rows in bold."""
    head = ["drafter", "lineage", "tokens", "steps", *METHODS]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        bold = "**" if r["chain"] == lineage else ""
        taus = [f"{r['tau'][m]:.2f}" if m in r["tau"] else "–" for m in METHODS]
        steps = f"{r['steps']:,}" if r["steps"] is not None else "–"
        cells = [f"{bold}{r['run']}{bold}", r["chain"], fmt_tokens(r["tokens_trained"]), steps, *taus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fits_table(rows: list[Row], lineage: str) -> str:
    """Per drafted method: the lineage's fit, the fit over every drafter, and the lineage's local slope."""
    own = [r for r in rows if r["chain"] == lineage]
    lines = ["| method | fit over | n | a | b (τ per doubling) | R² | local slope, last two |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for m in METHODS[1:]:
        slope = local_slope(own, m)
        for name, sel in ((lineage, own), ("all drafters", rows)):
            f = fit_method(sel, m)
            if f is None:
                continue
            last = f"{slope:+.3f}" if name == lineage and slope is not None else ""
            lines.append(f"| {m} | {name} | {f.n} | {f.a:.3f} | {f.b:+.3f} | {f.r2:.3f} | {last} |")
    return "\n".join(lines)


def goals_table(rows: list[Row], lineage: str, goals: dict[str, float]) -> str:
    """Tokens each fit needs for each goal, and the lineage's last local slope held from its last drafter."""
    own = [r for r in rows if r["chain"] == lineage]
    lines = [f"| goal | {lineage} fit | all-drafters fit | local slope held | last {lineage} |",
             "|---|---:|---:|---:|---:|"]
    for m, tau in goals.items():
        cells = [fmt_tokens(tokens_for(f, tau)) if f else "–" for f in (fit_method(own, m), fit_method(rows, m))]
        last = [r for r in own if m in r["tau"]][-1:]
        slope = local_slope(own, m)
        if last and slope is not None:  # the local slope as a fit through the last drafter
            t0, y0 = last[0]["tokens_trained"], last[0]["tau"][m]
            cells.append(fmt_tokens(tokens_for(Fit(y0 - slope * math.log2(t0), slope, math.nan, 2), tau)))
        else:
            cells.append("–")
        cells.append(f"{last[0]['tau'][m]:.2f} at {fmt_tokens(last[0]['tokens_trained'])}" if last else "–")
        lines.append(f"| {m} τ {tau} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot_method(ax, rows: list[Row], lineage: str, m: str, colour: str, goal: float | None, x_last: float) -> float:
    """One method's points and fitted line; returns how far right the line goes."""
    mine = points([r for r in rows if r["chain"] == lineage], m)
    other = points([r for r in rows if r["chain"] != lineage], m)
    if mine:
        ax.plot(*zip(*mine), "o-", color=colour, label=f"{m} ({lineage})")
    if other:
        ax.plot(*zip(*other), "o", mfc="none", color=colour)
    f = fit_method([r for r in rows if r["chain"] == lineage], m)
    if goal is not None:
        ax.axhline(goal, color=colour, ls=":", lw=1)
    if f is None:
        return x_last
    end = x_last
    if goal is not None:
        need = tokens_for(f, goal)
        end = min(max(need, x_last), 1024 * x_last)  # an absurd extrapolation is labelled, not drawn to scale
        ax.plot([end], [f.a + f.b * math.log2(end)], "*", color=colour, ms=10)
        ax.annotate(f"{m} τ {goal}: {fmt_tokens(need)}", (end, f.a + f.b * math.log2(end)), color=colour,
                    fontsize=8, textcoords="offset points", xytext=(-6, 6), ha="right")
    xs = [mine[0][0], end]
    ax.plot(xs, [f.a + f.b * math.log2(x) for x in xs], "--", color=colour, lw=1)
    return end


def _format_axes(ax, x_min: float, x_max: float, y_top: float, lineage: str) -> None:
    """log2 x axis with ticks at powers of two in M tokens; labels, legend."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.plot([], [], "o", mfc="none", color="0.3", label="other drafters (from zero, or another chain of sessions)")
    ax.plot([], [], "--", color="0.3", lw=1, label=f"fit τ = a + b·log2(tokens) over {lineage}")
    ax.set_xscale("log", base=2)
    ax.set_xlim(x_min, x_max)
    ticks = [2.0**k * 1e6 for k in range(0, 40) if x_min <= 2.0**k * 1e6 <= x_max]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t / 1e6:,.0f}" for t in ticks])
    ax.set_ylim(top=y_top)
    ax.set_xlabel("tokens trained (M, log2 scale)")
    ax.set_ylabel("MT-bench acceptance length τ")
    ax.set_title("Drafter quality against training tokens\n(SmolLM2-135M target; MT-bench, 80 questions, 256 tokens,"
                 " greedy, bf16, batch 1, one H200)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def plot(rows: list[Row], lineage: str, goals: dict[str, float], path: Path) -> None:
    """τ against tokens: lineage joined, others hollow, fits dashed out to the goals, prompt lookup as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    lookup = [r["tau"][LOOKUP] for r in rows if LOOKUP in r["tau"]]
    ax.axhspan(min(lookup) - 0.01, max(lookup) + 0.01, color="0.85", zorder=0)
    ax.axhline(sum(lookup) / len(lookup), color="0.45", lw=1,
               label=f"prompt lookup ({LOOKUP}, no drafter): {min(lookup):.2f}–{max(lookup):.2f}")
    x_last = max(r["tokens_trained"] for r in rows)
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    ends = [_plot_method(ax, rows, lineage, m, c, goals.get(m), x_last) for m, c in zip(METHODS[1:], colours)]
    y_top = max([*goals.values(), *(max(r["tau"].values()) for r in rows)]) + 0.2
    _format_axes(ax, min(r["tokens_trained"] for r in rows) / 1.25, max(ends) * 1.25, y_top, lineage)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_goals(specs: list[str]) -> dict[str, float]:
    goals = {}
    for spec in specs:
        method, _, tau = spec.rpartition("=")
        if method not in METHODS[1:]:
            raise SystemExit(f"--goal {spec}: METHOD is one of {', '.join(METHODS[1:])}")
        try:
            goals[method] = float(tau)
        except ValueError:
            raise SystemExit(f"--goal {spec}: TAU must be a number, e.g. {DEFAULT_GOALS[0]}") from None
    return goals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "logs" / "scaling.json")
    ap.add_argument("--chain", default="shipped", help="the lineage to fit (a value of the rows' 'chain')")
    ap.add_argument("--goal", action="append", metavar="METHOD=TAU",
                    help=f"repeatable; default {' '.join(DEFAULT_GOALS)}")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    args = ap.parse_args()
    rows = load(args.data)
    if not any(r["chain"] == args.chain for r in rows):
        raise SystemExit(f"no rows with chain {args.chain!r}: {sorted({r['chain'] for r in rows})}")
    goals = parse_goals(args.goal or list(DEFAULT_GOALS))
    print(table(rows, args.chain), end="\n\n")
    print(fits_table(rows, args.chain), end="\n\n")
    print(goals_table(rows, args.chain, goals))
    if args.plot:
        plot(rows, args.chain, goals, args.plot)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
