"""`hstap demo` (what `make demo` runs): the recipe (hstap/recipe) on the embedded default, end to end.

    hstap demo [--preset cpu|smoke|gpu] [--out runs/demo] [--stages STAGE,...]

Each preset is a shipped recipe, run through the same code as `hstap recipe`: `hstap demo --preset gpu --out D` runs
`hstap recipe --config smollm2-gpu --out D` (hstap/recipe/recipes/smollm2-gpu.yaml), then adds what only the
embedded default has.
1. prompts — ShareGPT's first user turns (cpu, smoke), or the recipe's mix of ShareGPT, Magpie and code (gpu)
2. synth   — SmolLM2 regenerates the answers (greedy, its own distribution)
3. capture — prefill those conversations with the tap on → a store (the gpu preset trains online instead)
4. train   — the EAGLE-3 drafter from the store (training-time test, held-out τ estimate)
5. eval    — speculative decoding on MT-bench against vanilla decoding, same backend, same run: τ and speedup;
             then the GPU recipe's drafter that ships in the package ('reference') on the same questions, with
             this machine's break-even τ (τ / speedup: below it a shape does not pay here)
6. export  — an SGLang/vLLM-loadable EAGLE-3 draft checkpoint
Each stage is recorded in OUT/recipe.json: a re-run skips what finished and continues what was interrupted;
`--stages` picks a subset.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from hstap.config import add_config_flags, option
from hstap.recipe.config import STAGES, Recipe, comma_separated, load_recipe

PRESETS = {"cpu": "smollm2-cpu", "smoke": "smollm2-smoke", "gpu": "smollm2-gpu"}  # preset → shipped recipe
SHIPPED = "reference"  # evaluated beside the demo's drafter: what the GPU recipe buys
SHIPPED_SHAPES = ("chain:3", "hybrid:4,2")


class DemoConfig(BaseModel):
    """The recipe on the embedded default: prompts → synth → capture → train → eval → export."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["cpu", "smoke", "gpu"] = option("cpu", "sizes: cpu (make demo), smoke (tests), gpu (one H100 or "
                                                           "H200)")
    out: Path = option(Path("runs/demo"), "run directory")
    stages: list[str] = option(list(STAGES), "comma-separated subset of " + ",".join(STAGES) + "; the others are "
                                             "left as an earlier run in --out left them", metavar="STAGE,...")

    @field_validator("stages", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return comma_separated(value)


def add_arguments(parser) -> None:
    add_config_flags(parser, DemoConfig, "demo")


def recipe_of(cfg: DemoConfig) -> Recipe:
    """The preset's shipped recipe with the demo's --out and --stages."""
    return load_recipe(PRESETS[cfg.preset], flags={"out": cfg.out, "stages": cfg.stages})


def plan(cfg: DemoConfig) -> str:
    from hstap.recipe.cli import plan as recipe_plan

    return recipe_plan(recipe_of(cfg))


def run(cfg: DemoConfig) -> int:
    from hstap.recipe.run import run_recipe

    result = run_recipe(recipe_of(cfg))
    shipped = None
    if "eval" in result.results:
        start = time.perf_counter()
        shipped = eval_shipped(result.results["eval"].config, Path(cfg.out) / "eval-shipped")
        result.seconds["eval"] += time.perf_counter() - start
    _final_table(prompt_sources(Path(cfg.out) / "prompts.jsonl"), result.results.get("train"),
                 result.results.get("eval"), shipped, result.results.get("export"), result.seconds, Path(cfg.out))
    return 0


def eval_shipped(evaluated: dict, out: Path):
    """The shipped drafter on the questions the demo's drafter was evaluated on (`evaluated`: its EvalConfig)."""
    from hstap.evaluate.config import EvalConfig, shape_fields
    from hstap.evaluate.run import run_eval

    print(f"\nthe shipped drafter '{SHIPPED}' (the GPU recipe's) on the same questions:", flush=True)
    shipped = run_eval(EvalConfig(drafter=SHIPPED, bench=evaluated["bench"], limit=evaluated["limit"],
                                  **shape_fields(list(SHIPPED_SHAPES)), max_new_tokens=evaluated["max_new_tokens"],
                                  device=evaluated["device"], out=out))
    print(shipped.summary())
    return shipped


def prompt_sources(path: Path) -> dict[str, int]:
    """Prompts per source in the prompts file (empty when there is none)."""
    counts: dict[str, int] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                source = json.loads(line).get("source", "?")
                counts[source] = counts.get(source, 0) + 1
    return counts


def verdict(result, method) -> str:
    """What a shape's measured speedup means, said plainly: a broken baseline (above τ: hstap.evaluate.run), no
    gain on this machine, or a gain."""
    speedup = result.speedup(method)
    if result.broken_baseline(method):
        return f"BROKEN BASELINE: above τ {method.tau:.2f}, vanilla decoding was not at its best"
    if speedup < 1:
        return "does not pay on this machine: slower than vanilla decoding"
    return "pays on this machine"


def _final_table(sources: dict[str, int], trained, evaluated, shipped, exported: Path | None, timings: dict,
                 out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    mix = ", ".join(f"{n} {name}" for name, n in sources.items())
    table = Table(title=f"hstap demo — SmolLM2-135M-Instruct, answers regenerated for {sum(sources.values())} "
                        f"prompts ({mix or 'none'})")
    for col in ("what", "value", "where"):
        table.add_column(col)
    h0, h1 = (trained.initial_heldout, trained.heldout) if trained else ({}, {})
    if "acc" in h0 and "acc" in h1:  # a held-out split exists (tiny runs may hold out nothing)
        table.add_row("held-out step-0 top-1", f"{h0['acc'][0]:.3f} → {h1['acc'][0]:.3f} (untrained → trained)",
                      str(trained.out / "accuracy.png"))
    for m in evaluated.methods if evaluated else []:
        table.add_row(f"τ, {m.shape.label}", f"{m.tau:.2f} ({len(evaluated.prompts)} MT-bench questions, greedy)",
                      str(evaluated.files[0].parent / "report.md"))
        table.add_row(f"speedup, {m.shape.label}",
                      f"{evaluated.speedup(m):.2f}× ({m.tokens_per_second:.1f} vs "
                      f"{evaluated.vanilla.tokens_per_second:.1f} tok/s vanilla): {verdict(evaluated, m)}", "")
    for m in shipped.methods if shipped else []:
        speedup = shipped.speedup(m)
        table.add_row(f"shipped drafter '{SHIPPED}' (GPU recipe), {m.shape.spec}",
                      f"τ {m.tau:.2f}, {speedup:.2f}× (break-even τ here {m.tau / speedup:.2f}): "
                      f"{verdict(shipped, m)}", str(shipped.files[0].parent / "report.md"))
    if trained:
        table.add_row("drafter", f"{trained.steps} steps, {trained.train_tokens} tokens", str(trained.out))
    if exported:
        table.add_row("SGLang/vLLM export", "LlamaForCausalLMEagle3", str(exported))
    table.add_row("time", " · ".join([*(f"{k} {v:.0f}s" for k, v in timings.items()),
                                      f"total {sum(timings.values()):.0f}s"]), str(out))
    Console().print(table)
