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
(`EvalResult.broken_baseline`, hstap.evaluate.results); one above τ within the noise is said too. Greedy shapes
must reproduce vanilla's answer; where one does not, the report gives the first differing position and the
target's margin there in rounding steps (hstap.evaluate.divergence), so a near tie that rounding flipped is told
from a bug.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from hstap.config import dtype_name
from hstap.data import SkipReport, open_source, render_prompt
from hstap.drafter import Eagle3Drafter
from hstap.drafter.load import load_drafter
from hstap.errors import HstapError
from hstap.evaluate.config import EvalConfig
from hstap.evaluate.divergence import first_divergence
from hstap.evaluate.methods import MeasuredGeneration, Methods
from hstap.evaluate.report import write_report
from hstap.evaluate.results import EvalResult, MethodResult, Prompt
from hstap.progress import progress_bar
from hstap.runtime.shapes import DraftShape
from hstap.runtime.target import PREFILL_BUCKET


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
                    on_prompt: Callable[[Prompt, dict[str, MeasuredGeneration]], None] | None = None,
                    batch_size: int = 1, cuda_graphs: bool | None = None, warm_each_batch: bool | None = None,
                    fused: bool | None = None, prefill: str = "lean",
                    prefill_bucket: int = PREFILL_BUCKET, kv_write: str = "scatter",
                    clock: Callable[[], float] = time.perf_counter) -> tuple[MethodResult, list[MethodResult]]:
    """Vanilla decoding and every draft shape on every prompt, batch by batch, methods interleaved per batch.

    All methods share one runtime (its graphs are captured during the warm-up). Each batch is seeded with
    `seed + index of its first prompt`. Warm-up runs (the first batch, up to 16 tokens) are not recorded.
    `warm_each_batch` (default: on CUDA) also runs every method untimed on each batch for one token first: on a
    GPU the first method to prefill a new prompt length through the drafter paid for the shape's first use (a
    graph captured, kernels chosen) that the methods after it, doing the same work, did not: chain:3, run first,
    measured a prefill nearly three times hybrid:4,2's, and vanilla paid the same. On a CPU the methods'
    prefills cost the same, so it stays off there (the demo's evaluation time).
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

    def run(shape: DraftShape | None, batch: list[Prompt], new_tokens: int, i: int) -> list[MeasuredGeneration]:
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
    with progress_bar(total=len(prompts), desc="eval", unit="prompt", disable=not progress) as bar:
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
             on_prompt: Callable[[Prompt, dict[str, MeasuredGeneration]], None] | None = None) -> EvalResult:
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
