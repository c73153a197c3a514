"""What an evaluation produces: the prompts, one `MethodResult` per decoding method (vanilla or a draft shape) and
the `EvalResult` that compares them, with `result_dict` (everything report.json holds).

    vanilla, methods = evaluate_shapes(model, drafter, prompts, shapes, 256, stop_ids)   # hstap.evaluate.run
    result = EvalResult(config, target, prompts, vanilla, methods)
    result.speedup(methods[0]), methods[0].tau, result.to_dict()

Its own module because other stages read these types too (hstap.train.calibrate simulates τ with them); it imports
no torch, so reading a result costs no model code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hstap.metrics import acceptance_length, tau_interval, tokens_per_second
from hstap.runtime.shapes import DraftShape

if TYPE_CHECKING:  # both import torch
    from hstap.evaluate.divergence import Divergence
    from hstap.evaluate.methods import MeasuredGeneration

# How far speedup / τ moves between runs of one evaluation for a shape whose cycle costs about one decoding step
# (prompt lookup on a CPU, where a 4-token forward costs what a 1-token one does; the runs are in
# docs/benchmarks.md, "broken baseline"). Above τ by more is a broken baseline; on a GPU (CUDA graphs) the spread is
# far smaller, so there this only errs towards silence.
BASELINE_NOISE = 0.05


@dataclass
class Prompt:
    """One evaluation prompt: its record's id and the token ids of its rendered first user turn."""

    id: str
    ids: list[int]


@dataclass
class MethodResult:
    """One decoding method (vanilla or a draft shape) over every prompt, in prompt order."""

    name: str
    shape: DraftShape | None
    generations: list[MeasuredGeneration]
    divergences: list[Divergence] | None = None  # greedy shapes: one per prompt whose answer differs from vanilla

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.generations)

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.tokens, self.seconds)

    @property
    def verify_forwards(self) -> int:
        return sum(g.verify_forwards for g in self.generations)

    @property
    def tau(self) -> float:
        forwards = self.verify_forwards
        return acceptance_length(sum(sum(g.emitted) for g in self.generations), forwards) if forwards else float("nan")

    def ms_per_cycle(self, stage: str) -> float:
        """Milliseconds of drafting ("draft"), verification ("verify") or the device waiting between cycles
        ("between") per cycle of the decoding loop (one verification forward of the whole batch), measured on the
        device (CUDA events; wall time on a CPU)."""
        spent = sum(getattr(g, f"{stage}_seconds") for g in self.generations)
        cycles = sum(g.cycles for g in self.generations)
        return 1000 * spent / cycles if cycles else float("nan")

    def prefill_ms_per_prompt(self) -> float:
        """Milliseconds per prompt of the prefill, first token and drafter start (outside the cycles)."""
        return 1000 * sum(g.prefill_seconds for g in self.generations) / max(len(self.generations), 1)

    def acceptance_per_position(self) -> list[float]:
        """Fraction of verification forwards whose k-th draft token was accepted, k = 1..depth."""
        steps = [a for g in self.generations for a in g.accepted]
        depth = self.shape.depth if self.shape else 0
        return [sum(a >= k for a in steps) / len(steps) if steps else float("nan") for k in range(1, depth + 1)]

    def tokens_per_forward(self) -> dict[int, int]:
        """Histogram of accepted + 1 (tokens a verification forward yields, before any cut at the end)."""
        hist: dict[int, int] = {}
        for a in (a for g in self.generations for a in g.accepted):
            hist[a + 1] = hist.get(a + 1, 0) + 1
        return dict(sorted(hist.items()))


@dataclass
class EvalResult:
    config: dict
    target: dict
    prompts: list[Prompt]
    vanilla: MethodResult
    methods: list[MethodResult]
    out_dir: Path | None = None
    files: list[Path] | None = None

    def speedup(self, method: MethodResult) -> float:
        base = self.vanilla.tokens_per_second
        return method.tokens_per_second / base if base > 0 else float("nan")

    def speedup_over_tau(self, method: MethodResult) -> float:
        """speedup / τ: at most 1 with vanilla decoding at its best (a cycle yields τ tokens for one verification
        of k ≥ 1 tokens plus drafting, and that verification costs at least one step of vanilla decoding)."""
        speedup, tau = self.speedup(method), method.tau
        return float("nan") if math.isnan(speedup) or math.isnan(tau) else speedup / tau

    def broken_baseline(self, method: MethodResult) -> bool:
        """Whether the shape's speedup exceeds its τ by more than timing noise (BASELINE_NOISE): vanilla decoding
        ran slower than the runtime's one-token step can."""
        return self.speedup_over_tau(method) > 1 + BASELINE_NOISE

    def greedy_matches(self, method: MethodResult) -> int | None:
        """Prompts whose output equals vanilla's token for token (greedy only; sampling differs by design)."""
        if self.config.get("temperature", 0) > 0:
            return None
        return sum(g.tokens == v.tokens for g, v in zip(method.generations, self.vanilla.generations))

    def to_dict(self) -> dict:
        """Everything report.json holds."""
        return result_dict(self)

    def summary(self) -> str:
        v = self.vanilla
        lines = [f"{len(self.prompts)} prompts, T={self.config.get('temperature', 0)}: vanilla "
                 f"{v.tokens_per_second:.1f} tok/s"]
        for m in self.methods:
            match = self.greedy_matches(m)
            same = "" if match is None else f", identical to vanilla on {match}/{len(self.prompts)}"
            rounding = "" if not m.divergences else \
                f" ({sum(d.within_rounding for d in m.divergences)} of {len(m.divergences)} differing within rounding)"
            lines.append(f"{m.shape.label}: τ {m.tau:.2f}, {m.tokens_per_second:.1f} tok/s, speedup "
                         f"{self.speedup(m):.2f}x{same}{rounding}")
            over = self.speedup_over_tau(m)
            if self.broken_baseline(m):
                lines.append(f"  BROKEN BASELINE: speedup {self.speedup(m):.2f}x above τ {m.tau:.2f}: vanilla "
                             "decoding ran slower than the runtime's one-token step can")
            elif over > 1:
                lines.append(f"  speedup above τ by {100 * (over - 1):.1f} %, within timing noise "
                             f"({100 * BASELINE_NOISE:.0f} %): a cycle here costs about one decoding step")
        if self.files:
            lines.append(f"report: {self.files[0].parent}/report.md")
        return "\n".join(lines)


REPORT_FORMAT = 1


def _num(x: float) -> float | None:
    """JSON has no NaN: undefined values (e.g. τ with no verification forward) become null."""
    return None if isinstance(x, float) and math.isnan(x) else x


def result_dict(result: EvalResult) -> dict:
    """Everything report.json holds: config, totals per method, per-prompt numbers."""
    v = result.vanilla
    shapes = []
    for m in result.methods:
        drafted = [d for g in m.generations for d in g.drafted]
        shapes.append({
            "shape": m.name, "label": m.shape.label, "tau": _num(m.tau), "tau_interval_95": _tau_interval(m),
            "verify_forwards": m.verify_forwards,
            "tokens": m.tokens, "seconds": m.seconds, "tokens_per_second": m.tokens_per_second,
            "speedup": _num(result.speedup(m)),
            "acceptance_per_position": [_num(a) for a in m.acceptance_per_position()],
            "tokens_per_forward_histogram": {str(k): n for k, n in m.tokens_per_forward().items()},
            "mean_draft_tokens": sum(drafted) / len(drafted) if drafted else 0.0,
            "draft_ms_per_cycle": _num(m.ms_per_cycle("draft")), "verify_ms_per_cycle": _num(m.ms_per_cycle("verify")),
            "between_ms_per_cycle": _num(m.ms_per_cycle("between")), "prefill_ms_per_prompt": m.prefill_ms_per_prompt(),
            "greedy_matches_vanilla": result.greedy_matches(m), "broken_baseline": result.broken_baseline(m),
            "speedup_over_tau": _num(result.speedup_over_tau(m)),
            "divergences": None if m.divergences is None else [d.to_dict() for d in m.divergences],
            "divergences_within_rounding": None if m.divergences is None else
            sum(d.within_rounding for d in m.divergences),
        })
    per_prompt = []
    for i, prompt in enumerate(result.prompts):
        base = v.generations[i]
        row = {"id": prompt.id, "prompt_tokens": len(prompt.ids),
               "vanilla": {"tokens": len(base.tokens), "seconds": base.seconds,
                           "tokens_per_second": _tps(base)}}
        for m in result.methods:
            g = m.generations[i]
            row[m.name] = {"tokens": len(g.tokens), "tau": _num(g.tau), "verify_forwards": g.verify_forwards,
                           "seconds": g.seconds, "tokens_per_second": _tps(g),
                           "speedup": _tps(g) / _tps(base) if _tps(base) > 0 else None,
                           "matches_vanilla": g.tokens == base.tokens}
        per_prompt.append(row)
    return {
        "hstap_eval": REPORT_FORMAT, "baseline_noise": BASELINE_NOISE,
        "config": result.config,
        "target": result.target,
        "prompts": len(result.prompts),
        "vanilla": {"tokens": v.tokens, "seconds": v.seconds, "tokens_per_second": v.tokens_per_second,
                    "verify_forwards": v.verify_forwards},
        "shapes": shapes,
        "per_prompt": per_prompt,
    }


def _tau_interval(m: MethodResult) -> list[float] | None:
    """τ's 95 % bootstrap interval over the prompts (hstap.metrics.tau_interval); None without a forward."""
    pairs = [(sum(g.emitted), g.verify_forwards) for g in m.generations if g.verify_forwards]
    return list(tau_interval(pairs)) if pairs else None


def _tps(g: MeasuredGeneration) -> float:
    return tokens_per_second(len(g.tokens), g.seconds)
