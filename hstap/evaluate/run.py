"""`hstap eval`: speculative decoding with the embedded target against vanilla decoding, in one run.

    hstap eval --drafter runs/drafter --bench mt-bench --limit 20 --chain 3 --tree 8,8,60

Prompts are the first user turn of each conversation (with any system message before it): for MT-bench the first
of its two turns. For every prompt, vanilla decoding and then each draft shape run back to back on the same
backend (transformers, batch 1, DynamicCache), after `warmup` untimed runs of each on the first prompt. Writes
report.json, report.md and plots into the drafter's run directory (or `out`).

For a benchmark script: `evaluate_shapes(model, drafter, prompts, shapes, ...)` measures several draft shapes
against one vanilla baseline without touching the disk.

Two checks keep the figures honest. A verification of k ≥ 1 tokens never costs less than the best one-token step,
so no shape can be faster than τ times vanilla decoding: a speedup above τ by more than timing noise
(BASELINE_NOISE) means the baseline was not decoding at its best, and the report and the summary say so
(`EvalResult.broken_baseline`); one above τ within the noise is said too. Greedy shapes must reproduce
vanilla's answer; where one does not, the report gives the first differing position and the target's margin
there in rounding steps (hstap.evaluate.divergence), so a near tie that rounding flipped is told from a bug.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hstap.config import dtype_name
from hstap.data import SkipReport, open_source, render_prompt
from hstap.drafter import Eagle3Drafter
from hstap.drafter.shipped import resolve_drafter
from hstap.errors import HstapError
from hstap.evaluate.config import EvalConfig
from hstap.evaluate.divergence import Divergence, first_divergence
from hstap.evaluate.report import write_report
from hstap.evaluate.spec import Generation, Methods
from hstap.metrics import acceptance_length, tau_interval, tokens_per_second
from hstap.runtime.shapes import DraftShape
from hstap.runtime.target import PREFILL_BUCKET

# How far speedup / τ moves between runs of one evaluation for a shape whose cycle costs about one decoding step
# (prompt lookup on a CPU, where a 4-token forward costs what a 1-token one does): `hstap eval --drafter reference
# --bench mt-bench --limit 4 --ngram 3 --chain 3 --max-new-tokens 48`, fourteen runs on a 2-core CPU shared with
# other jobs, 2026-12-06: ngram:3 0.96-1.04 (docs/benchmarks.md). Above τ by more is a broken baseline (before the
# one-token step took the fastest product, the same runs gave 1.41-1.55); on a GPU (CUDA graphs) the spread is far
# smaller, so there this only errs towards silence.
BASELINE_NOISE = 0.05


@dataclass
class Prompt:
    id: str
    ids: list[int]


@dataclass
class MethodResult:
    """One decoding method (vanilla or a draft shape) over every prompt, in prompt order."""

    name: str
    shape: DraftShape | None
    generations: list[Generation]
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


def _tau_interval(m) -> list[float] | None:
    """τ's 95 % bootstrap interval over the prompts (hstap.metrics.tau_interval); None without a forward."""
    pairs = [(sum(g.emitted), g.verify_forwards) for g in m.generations if g.verify_forwards]
    return list(tau_interval(pairs)) if pairs else None


def _tps(g: Generation) -> float:
    return tokens_per_second(len(g.tokens), g.seconds)



def load_prompts(bench: str, tokenizer, limit: int | None = None, report: SkipReport | None = None) -> list[Prompt]:
    """First user turn (and any system message before it) of each conversation, rendered with the template.
    Records left out (malformed, no user turn) are counted in `report`, the first by its file and line."""
    prompts = []
    report = SkipReport() if report is None else report
    for conv in open_source(bench, limit=limit, report=report):
        first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), None)
        if first_user is not None:
            prompts.append(Prompt(conv.id, render_prompt(conv.messages[: first_user + 1], tokenizer)))
        else:
            report.add("no_user_turn", where=f"{conv.source} record {conv.id!r}")
    if not prompts:
        raise HstapError(f"--bench {bench}: no conversation with a user turn ({report.summary()})")
    return prompts


def evaluate_shapes(model: torch.nn.Module, drafter: Eagle3Drafter | None, prompts: list[Prompt],
                    shapes: list[DraftShape], max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                    seed: int = 0, warmup: int = 1, progress: bool = True,
                    on_prompt: Callable[[Prompt, dict[str, Generation]], None] | None = None,
                    batch_size: int = 1, cuda_graphs: bool | None = None, warm_each_batch: bool | None = None,
                    fused: bool | None = None, prefill: str = "lean",
                    prefill_bucket: int = PREFILL_BUCKET, kv_write: str = "scatter",
                    clock: Callable[[], float] = time.perf_counter) -> tuple[MethodResult, list[MethodResult]]:
    """Vanilla decoding and every draft shape on every prompt, batch by batch, methods interleaved per batch.

    All methods share one runtime (its graphs are captured during the warm-up). Each batch is seeded with
    `seed + index of its first prompt`. Warm-up runs (the first batch, up to 16 tokens) are not recorded.
    `warm_each_batch` (default: on CUDA) also runs every method untimed on each batch for one token first: on an
    H200 the first method to prefill a new prompt length through the drafter paid ~40 ms more than the next
    ones doing the same work (chain:3's prefill 63 ms per prompt against 23 ms for hybrid:4,2 and the trees
    right after it, 2026-12-02), a cost of the shape's first use that vanilla, run first, paid too. On a CPU
    the methods' prefills cost the same, so it stays off there (the demo's evaluation time).
    `fused` (default: on CUDA): the decoders' graph bodies run compiled (hstap.runtime.spec.SpecDecoder).
    `prefill`: the runtime's prefill path ("lean" or transformers' "model", hstap.runtime.target.Runtime);
    `prefill_bucket`: with CUDA graphs, the width bucket of the graph-replayed prefill (0: eager prefills).
    `kv_write`: the target cache's write form (hstap.runtime.kv.KVCache).
    `on_prompt(prompt, {method name: generation})` sees each prompt's results as its batch completes (a long
    benchmark logs them, so a run cut short still has its finished prompts). `clock`: the seconds every timed
    batch is measured with (tests pass one they control). Greedy runs then find where each shape's answers
    leave vanilla's, untimed (`MethodResult.divergences`). Returns (vanilla, one MethodResult per shape)."""
    longest = max(len(p.ids) for p in prompts) + max_new_tokens
    methods = Methods(model, drafter, batch_size, longest, shapes, cuda_graphs, fused, prefill, prefill_bucket,
                      kv_write, clock)
    device = methods.runtime.device

    def run(shape: DraftShape | None, batch: list[Prompt], new_tokens: int, i: int) -> list[Generation]:
        generator = torch.Generator(device=device).manual_seed(seed + i)
        return methods.run(shape, [p.ids for p in batch], new_tokens, stop_ids, temperature, generator)

    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    for _ in range(warmup):
        for shape in [None, *shapes]:
            run(shape, batches[0], min(16, max_new_tokens), 0)
    if warm_each_batch is None:
        warm_each_batch = device.type == "cuda"
    vanilla = MethodResult("vanilla", None, [])
    results = [MethodResult(s.spec, s, []) for s in shapes]
    with tqdm(total=len(prompts), desc="eval", unit="prompt", disable=not progress) as bar:
        for k, batch in enumerate(batches):
            first = k * batch_size
            if warm_each_batch:  # this batch's prompt shapes seen once by every method, untimed
                for shape in [None, *shapes]:
                    run(shape, batch, 1, first)
            vanilla.generations += run(None, batch, max_new_tokens, first)
            for method in results:
                method.generations += run(method.shape, batch, max_new_tokens, first)
            for j, prompt in enumerate(batch):
                if on_prompt is not None:
                    on_prompt(prompt, {m.name: m.generations[first + j] for m in [vanilla, *results]})
            bar.update(len(batch))
    if temperature == 0:  # sampled answers differ from vanilla's by design
        for method in results:
            found = [first_divergence(methods.runtime, p.id, p.ids, v.tokens, g.tokens)
                     for p, v, g in zip(prompts, vanilla.generations, method.generations)]
            method.divergences = [d for d in found if d is not None]
    return vanilla, results


def load_drafter(run_dir: Path | str, target) -> Eagle3Drafter:
    """The drafter of a `hstap train` run directory (or a shipped drafter's name), checked against the target and
    placed on its device."""
    run_dir = resolve_drafter(run_dir)
    drafter = Eagle3Drafter.from_pretrained(run_dir, target_model=target.model)
    cfg = drafter.config
    if cfg.target_fingerprint != target.fingerprint:
        raise HstapError(f"{run_dir} was trained against {cfg.target_model_id} (fingerprint "
                         f"{cfg.target_fingerprint}); the target loaded has fingerprint {target.fingerprint}: "
                         "pass the --model it was trained for")
    if cfg.vocab_size != target.model.config.vocab_size or max(cfg.aux_layer_ids) >= target.num_layers:
        raise HstapError(f"{run_dir}: drafter expects vocab {cfg.vocab_size} and layers {cfg.aux_layer_ids}, "
                         f"the target has vocab {target.model.config.vocab_size} and {target.num_layers} layers")
    return drafter.to(device=target.model.device, dtype=target.model.dtype).eval()


def _products(model: torch.nn.Module) -> str | None:
    """Which product each row count of the target's projections ran (hstap.runtime.linear), as measured when its
    runtime was built; None where nothing was measured (no oneDNN copies: a GPU, bf16, HSTAP_CPU_REORDER=0)."""
    from hstap.runtime.llama import LeanLlama

    products = LeanLlama(model).products  # the fused weights and the choice are cached: nothing is measured again
    return None if products is None else products.describe()


def _report_dir(drafter: Path) -> Path:
    """Reports go beside a drafter directory; a shipped drafter's name (its files live in the cache) gets
    runs/eval-NAME."""
    return drafter if drafter.exists() else Path("runs") / f"eval-{drafter}"


def run_eval(cfg: EvalConfig, progress: bool = True,
             on_prompt: Callable[[Prompt, dict[str, Generation]], None] | None = None) -> EvalResult:
    """Load target (+ drafter), measure vanilla and every shape on the prompts, write the report."""
    from hstap.config import torch_dtype
    from hstap.models import load_target
    from hstap.preflight import check_out_dir

    out_dir = Path(cfg.out or _report_dir(cfg.drafter))
    check_out_dir(out_dir, flag="--out" if cfg.out else "--out (default: beside --drafter)")  # before any model loads
    target = load_target(cfg.model, device=cfg.device, dtype=torch_dtype(cfg.dtype) if cfg.dtype else None)
    drafter = load_drafter(cfg.drafter, target) if cfg.drafter is not None else None
    skips = SkipReport()
    prompts = load_prompts(cfg.bench, target.tokenizer, cfg.limit, skips)
    if skips.total:  # said before the run, on stderr: --json keeps stdout for the report
        tqdm.write(f"hstap eval: --bench {cfg.bench}: {skips.skipped_line()}", file=sys.stderr)
    shapes = [DraftShape.parse(s) for s in cfg.shapes]
    vanilla, methods = evaluate_shapes(target.model, drafter, prompts, shapes, cfg.max_new_tokens,
                                       set(target.stop_ids), cfg.temperature, cfg.seed, cfg.warmup, progress,
                                       on_prompt, cfg.batch, cfg.cuda_graphs)
    result = EvalResult(config=cfg.resolved(),
                        target={"model_id": target.model_id, "fingerprint": target.fingerprint,
                                "device": str(target.model.device), "dtype": dtype_name(target.model.dtype),
                                "torch_threads": torch.get_num_threads(), "cpu_products": _products(target.model)},
                        prompts=prompts, vanilla=vanilla, methods=methods)
    result.out_dir = out_dir
    result.files = save_report(result.to_dict(), out_dir)
    return result


def save_report(report: dict, out_dir: Path) -> list[Path]:
    """`write_report`, never losing the results to a late write failure (the directory made read-only or the disk
    filled during the run): they are written to a fresh temporary directory instead — or, failing that too,
    printed on stdout — and the one-line error says where they are."""
    import json
    import tempfile

    try:
        return write_report(report, out_dir)
    except OSError as exc:
        why = f"{out_dir}: cannot write the report ({exc.strerror or exc})"
    try:
        fallback = Path(tempfile.mkdtemp(prefix="hstap-eval-"))
        write_report(report, fallback)
    except OSError:
        print(json.dumps(report, indent=2))
        raise HstapError(f"{why}; nor in a temporary directory: report.json is printed above on stdout") from None
    raise HstapError(f"{why}; the results were saved in {fallback} instead (report.json, report.md)")
