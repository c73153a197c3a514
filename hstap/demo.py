"""`hstap demo` (what `make demo` runs): the whole job on the embedded default, end to end.

    hstap demo [--preset cpu|gpu] [--out runs/demo]

1. synth   — SmolLM2 regenerates the answers to short ShareGPT prompts (greedy, its own distribution)
2. capture — prefill those conversations with the tap on → a store
3. train   — the EAGLE-3 drafter from the store (training-time test, held-out τ estimate)
4. eval    — speculative decoding on MT-bench against vanilla decoding, same backend, same run: τ and speedup;
             then the GPU recipe's drafter that ships in the package ('reference') on the same questions, with
             this machine's break-even τ (τ / speedup: below it a shape does not pay here)
5. export  — an SGLang/vLLM-loadable EAGLE-3 draft checkpoint
Each stage resumes or reuses what an earlier run of the same preset left in `--out`; `--stages` picks a subset.
The gpu preset trains online (stage 2 skipped) within a fixed time budget.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from hstap.config import add_config_flags, option


@dataclass(frozen=True)
class Preset:
    prompts: int  # ShareGPT prompts regenerated and trained on
    prompt_chars: int  # keep first user turns shorter than this (long prompts cost prefill, not answers)
    new_tokens: int  # synth answer length cap
    synth_batch: int
    max_tokens: int  # capture/train sample cap
    epochs: int
    ttt_steps: int
    draft_vocab: int
    lr: float
    batch_tokens: int
    eval_questions: int
    eval_new_tokens: int
    shapes: dict  # EvalConfig's shape fields: ngram=[K...], chain=[K...], tree=["D,TOPK,N", ...]
    device: str
    online: bool = False  # train with the target in-process instead of capturing a store first
    train_budget_s: float | None = None  # fit training into this wall time (epochs is then a cap)
    calib_prompts: int = 0  # held-out prompts decoded at every evaluation to measure τ (seconds each on a GPU)
    calib_tokens: int = 64
    shipped: str | None = "reference"  # evaluated beside the demo's drafter: what the GPU recipe buys
    shipped_shapes: tuple = ("chain:3", "hybrid:4,2")


PRESETS = {
    # sized to finish in well under 15 minutes on 2 CPU cores (docs/benchmarks.md has the measured time)
    "cpu": Preset(prompts=96, prompt_chars=400, new_tokens=128, synth_batch=16, max_tokens=320, epochs=4,
                  ttt_steps=4, draft_vocab=4096, lr=3e-3, batch_tokens=2048, eval_questions=8,
                  eval_new_tokens=64, shapes={"ngram": [3], "chain": [3]}, device="cpu", calib_prompts=2,
                  calib_tokens=32),
    # the whole path in about a minute, for the smoke test (tests/test_demo.py); proves wiring, not quality
    "smoke": Preset(prompts=6, prompt_chars=300, new_tokens=16, synth_batch=6, max_tokens=128, epochs=1,
                    ttt_steps=2, draft_vocab=512, lr=3e-3, batch_tokens=1024, eval_questions=1,
                    eval_new_tokens=12, shapes={"ngram": [2], "chain": [2]}, device="cpu"),
    # one H200: every ShareGPT prompt regenerated, online training fitted into 7 minutes (a store of these states
    # would be ~30 GB and cost more to write and read than the target's prefill costs to redo every epoch). Answers
    # capped at 256 tokens: on the H200 a 256 cap trained drafters as good as a 384 cap at equal steps (MT-bench
    # chain-3 +0.03 τ, tree +0.00) and answered 22 % more prompts a second (docs/benchmarks.md, fifteenth run)
    "gpu": Preset(prompts=12000, prompt_chars=2000, new_tokens=256, synth_batch=256, max_tokens=2048, epochs=40,
                  ttt_steps=7, draft_vocab=16384, lr=2e-3, batch_tokens=16384, eval_questions=80,
                  eval_new_tokens=256, shapes={"ngram": [3], "chain": [3], "tree": ["8,8,60"]}, device="cuda",
                  online=True, train_budget_s=420, calib_prompts=4),
}
STAGES = ("synth", "capture", "train", "eval", "export")


class DemoConfig(BaseModel):
    """The main job on the embedded default: synth → capture → train → eval → export."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["cpu", "smoke", "gpu"] = option("cpu", "sizes: cpu (make demo), smoke (tests), gpu (one H200)")
    out: Path = option(Path("runs/demo"), "run directory")
    stages: list[str] = option(list(STAGES), "comma-separated subset of synth,capture,train,eval,export; the others "
                                             "reuse what an earlier run left in --out", metavar="STAGE,...")

    @field_validator("stages", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):
            value = [value]
        names = [name.strip() for item in value for name in str(item).split(",") if name.strip()]
        unknown = sorted(set(names) - set(STAGES))
        if unknown or not names:
            raise ValueError(f"expected a comma-separated subset of {','.join(STAGES)}")
        return names


def add_arguments(parser) -> None:
    add_config_flags(parser, DemoConfig, "demo")


def short_prompts(out: Path, count: int, max_chars: int) -> tuple[Path, int]:
    """The first `count` ShareGPT conversations whose first user turn is short, as a JSONL of prompts."""
    from hstap.data import SkipReport, iter_sharegpt

    path = out / "prompts.jsonl"
    if path.exists():
        return path, sum(1 for _ in open(path))
    rows, report = [], SkipReport()
    for conv in iter_sharegpt(report=report):
        first = conv.messages[0] if conv.messages[0]["role"] == "user" else conv.messages[1]
        if len(first["content"]) < max_chars:
            rows.append({"id": conv.id, "messages": [first]})
        if len(rows) == count:
            break
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path, len(rows)


def run(cfg: DemoConfig) -> int:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.run import run_capture
    from hstap.evaluate.config import EvalConfig, shape_fields
    from hstap.evaluate.run import run_eval
    from hstap.export.write import export_drafter
    from hstap.synth.config import SynthConfig
    from hstap.synth.run import run_synth
    from hstap.train.config import TrainConfig
    from hstap.train.run import run_train

    p, out, stages = PRESETS[cfg.preset], Path(cfg.out), cfg.stages
    timings: dict[str, float] = {}

    def stage(name: str):
        print(f"\n── {name} " + "─" * (60 - len(name)), flush=True)
        timings[name] = time.perf_counter()

    def done(name: str) -> None:
        timings[name] = time.perf_counter() - timings[name]

    prompts, n = short_prompts(out, p.prompts, p.prompt_chars)
    synth_out, store, drafter = out / "synth.jsonl", out / "store", out / "drafter"
    trained = evaluated = shipped = exported = None
    if "synth" in stages:
        stage("synth")
        synth = run_synth(SynthConfig(model="smollm2", data=f"jsonl:{prompts}", out=synth_out,
                                      max_new_tokens=p.new_tokens, batch_size=p.synth_batch, device=p.device))
        print(synth.summary())
        done("synth")

    if "capture" in stages and p.online:
        print("\n── capture: online preset — the target runs inside training, nothing is stored", flush=True)
    elif "capture" in stages:
        stage("capture")
        cap = run_capture(CaptureConfig(data=f"jsonl:{synth_out}", out=store, max_tokens=p.max_tokens,
                                        device=p.device, batch_tokens=max(p.batch_tokens, 4096)))
        print(cap.summary())
        done("capture")

    if "train" in stages:
        stage("train")
        source = dict(online=True, data=f"jsonl:{synth_out}", max_tokens=p.max_tokens) if p.online else \
            dict(store=store)
        trained = run_train(TrainConfig(**source, out=drafter, epochs=p.epochs, ttt_steps=p.ttt_steps,
                                        draft_vocab=p.draft_vocab, lr=p.lr, batch_tokens=p.batch_tokens,
                                        device=p.device, heldout=0.05, time_budget_s=p.train_budget_s,
                                        calib_prompts=p.calib_prompts, calib_tokens=p.calib_tokens,
                                        overwrite=True))  # the demo retrains in its own directory on a re-run
        print(trained.summary())
        done("train")

    if "eval" in stages:
        stage("eval")
        evaluated = run_eval(EvalConfig(drafter=drafter, bench="mt-bench", limit=p.eval_questions, **p.shapes,
                                        max_new_tokens=p.eval_new_tokens, device=p.device))
        print(evaluated.summary())
        if p.shipped:
            print(f"\nthe shipped drafter '{p.shipped}' (the GPU recipe's) on the same questions:")
            shipped = run_eval(EvalConfig(drafter=p.shipped, bench="mt-bench", limit=p.eval_questions,
                                          **shape_fields(list(p.shipped_shapes)), max_new_tokens=p.eval_new_tokens,
                                          device=p.device, out=out / "eval-shipped"))
            print(shipped.summary())
        done("eval")

    if "export" in stages:
        stage("export")
        exported = export_drafter(drafter, "sglang", out / "export-sglang", force=True)
        done("export")

    _final_table(p, n, trained, evaluated, shipped, exported, timings, out)
    return 0


def verdict(result, method) -> str:
    """What a shape's measured speedup means, said plainly: a broken baseline (above τ: hstap.evaluate.run), no
    gain on this machine, or a gain."""
    speedup = result.speedup(method)
    if result.broken_baseline(method):
        return f"BROKEN BASELINE: above τ {method.tau:.2f}, vanilla decoding was not at its best"
    if speedup < 1:
        return "does not pay on this machine: slower than vanilla decoding"
    return "pays on this machine"


def _final_table(p: Preset, prompts: int, trained, evaluated, shipped, exported: Path | None, timings: dict,
                 out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hstap demo — SmolLM2-135M-Instruct, answers regenerated for {prompts} ShareGPT prompts")
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
        table.add_row(f"shipped drafter '{p.shipped}' (GPU recipe), {m.shape.spec}",
                      f"τ {m.tau:.2f}, {speedup:.2f}× (break-even τ here {m.tau / speedup:.2f}): "
                      f"{verdict(shipped, m)}", str(shipped.files[0].parent / "report.md"))
    if trained:
        table.add_row("drafter", f"{trained.steps} steps, {trained.train_tokens} tokens", str(trained.out))
    if exported:
        table.add_row("SGLang/vLLM export", "LlamaForCausalLMEagle3", str(exported))
    table.add_row("time", " · ".join(f"{k} {v:.0f}s" for k, v in timings.items()) +
                  f" · total {sum(timings.values()):.0f}s", str(out))
    Console().print(table)
