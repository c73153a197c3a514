"""The evaluation report: report.json (everything), report.md (tables + plots), two PNG plots.

    write_report(result.to_dict(), run_dir)
    # → report.json, report.md, acceptance_per_position.png, tau_distribution.png

Plots: acceptance rate per draft position (one line per shape) and the τ distribution (tokens per verification
forward over all forwards, and τ per prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

from hstap.plots import plt, save_figure


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """Write report.json, report.md and the plots into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plots = [plot_acceptance(report, out / "acceptance_per_position.png"),
             plot_tau(report, out / "tau_distribution.png")]
    md_path = out / "report.md"
    md_path.write_text(markdown(report, [p.name for p in plots]))
    return [json_path, md_path, *plots]


def _fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict, plot_names: list[str]) -> str:
    cfg, tgt, v = report["config"], report["target"], report["vanilla"]
    lines = [
        "# hstap eval", "",
        f"Target `{tgt['model_id']}` ({tgt['dtype']} on {tgt['device']}, {tgt['torch_threads']} threads), drafter "
        f"`{cfg['drafter']}`, bench `{cfg['bench']}` ({report['prompts']} prompts, first user turn), temperature "
        f"{cfg['temperature']}, max {cfg['max_new_tokens']} new tokens, batch {cfg.get('batch', 1)}, "
        f"{cfg['warmup']} warm-up run(s) excluded. Every method runs on hstap's runtime (static KV cache; CUDA "
        "graphs on a GPU).",
        "",
        "τ = tokens per target verification forward, bonus token included (the prefill's first token excluded); "
        "in brackets its 95 % bootstrap interval over the prompts (how far another draw of such prompts could "
        "move it). "
        "Speedup = tokens/s against vanilla decoding on the same backend, measured in the same run. It cannot "
        "exceed τ (a verification of k ≥ 1 tokens costs at least vanilla's best one-token step): a speedup above "
        f"τ by more than timing noise ({100 * report.get('baseline_noise', 0.05):.0f} %) is marked **broken "
        "baseline**, one above τ within it *within noise*.", "",
        "| method | τ | acceptance per position | draft tokens | tokens/s | speedup | ms per cycle: draft / verify / "
        "between | same as vanilla |",
        "|---|---|---|---|---|---|---|---|",
        f"| vanilla | 1.00 | – | 0 | {v['tokens_per_second']:.1f} | 1.00x | – | – |",
    ]
    for s in report["shapes"]:
        acc = " ".join(_fmt(a) for a in s["acceptance_per_position"])
        same = "–" if s["greedy_matches_vanilla"] is None else f"{s['greedy_matches_vanilla']}/{report['prompts']}"
        ms = " / ".join(_fmt(s.get(f"{k}_ms_per_cycle"), ".1f") for k in ("draft", "verify", "between"))
        interval = s.get("tau_interval_95")  # reports before 2026-12-03 lack it
        tau = _fmt(s["tau"]) + (f" ({interval[0]:.2f}–{interval[1]:.2f})" if interval else "")
        over = s.get("speedup_over_tau") or 0.0  # reports before 2026-12-06 lack it
        broken = " **broken baseline: above τ**" if s.get("broken_baseline") else " *within noise*" if over > 1 else ""
        lines.append(f"| {s['label']} | {tau} | {acc} | {s['mean_draft_tokens']:.1f} | "
                     f"{s['tokens_per_second']:.1f} | {_fmt(s['speedup'])}x{broken} | {ms} | {same} |")
    products = tgt.get("cpu_products")
    if products:
        lines += ["", f"Projections: {products}."]
    lines += divergence_lines(report)
    lines += [""] + [f"![{name}]({name})" for name in plot_names] + ["", "## Per prompt", ""]
    names = [s["shape"] for s in report["shapes"]]
    lines.append("| prompt | prompt tokens | vanilla tok/s | " + " | ".join(f"{n} τ / speedup" for n in names) + " |")
    lines.append("|---" * (3 + len(names)) + "|")
    for row in report["per_prompt"]:
        cells = [f"{_fmt(row[n]['tau'])} / {_fmt(row[n]['speedup'])}x" for n in names]
        lines.append(f"| {row['id']} | {row['prompt_tokens']} | {row['vanilla']['tokens_per_second']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def divergence_lines(report: dict) -> list[str]:
    """The greedy answers that left vanilla's: per shape, where, and the target's margin there in rounding steps
    of its dtype (hstap.evaluate.divergence)."""
    shapes = [s for s in report["shapes"] if s.get("divergences")]
    if not shapes:
        return []
    lines = ["", "## Greedy answers that differ from vanilla", "",
             ("First differing token of each such answer (0 = the prefill's token), the two tokens chosen there and "
              "the target's logit margin between them in rounding steps of its dtype at that magnitude; within "
              "rounding = the target's top two, no further apart than two computations of the same logits drift."),
             "", "| shape | within rounding | prompt | position | vanilla / shape token | margin (ulps) | top two |",
             "|---|---:|---|---:|---|---:|---|"]
    for s in shapes:
        divs = s["divergences"]
        count = f"{s['divergences_within_rounding']}/{len(divs)}"
        for k, d in enumerate(divs):
            lines.append(f"| {s['label'] if k == 0 else ''} | {count if k == 0 else ''} | {d['prompt']} | "
                         f"{d['position']} | {d['vanilla_token']} / {d['shape_token']} | "
                         f"{_fmt(d['margin_ulps'], '.1f')} | {'yes' if d['top_two'] else 'no'} |")
    return lines


def plot_acceptance(report: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in report["shapes"]:
        acc = [a if a is not None else float("nan") for a in s["acceptance_per_position"]]
        ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"{s['label']} (τ {_fmt(s['tau'])})")
    ax.set_xlabel("draft position (depth)"), ax.set_ylabel("fraction of verifications accepting it")
    ax.set_ylim(0, 1), ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_tau(report: dict, path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = max(len(report["shapes"]), 1)
    width = 0.8 / n
    for j, s in enumerate(report["shapes"]):
        hist = {int(k): c for k, c in s["tokens_per_forward_histogram"].items()}
        total = sum(hist.values()) or 1
        left.bar([k + (j - (n - 1) / 2) * width for k in hist], [c / total for c in hist.values()], width=width,
                 label=s["label"])
        taus = [row[s["shape"]]["tau"] for row in report["per_prompt"] if row[s["shape"]]["tau"] is not None]
        right.hist(taus, bins=20, alpha=0.6, label=s["label"])
    left.set_xlabel("tokens per verification forward (accepted + bonus)"), left.set_ylabel("fraction of forwards")
    right.set_xlabel("τ per prompt"), right.set_ylabel("prompts")
    left.legend(fontsize=8), right.legend(fontsize=8)
    return save_figure(fig, path)
