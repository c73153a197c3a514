"""OUT/recipe.json: the stages that started and finished, each with the settings it ran with.

    state = RecipeState(Path("runs/recipe"))
    action = decide("synth", state.stages.get("synth"), fp, lambda: ("synth.seed 0 → 1", "synth"), False, state.path)

A stage's fingerprint hashes its config — less HOW, the fields that change how it runs but not what it makes (a
batch size, a server's address) — and the fingerprint of the stage whose output it reads, so a change upstream
reaches every stage after it. On a run, a stage
- that finished with the same fingerprint is skipped;
- that started with the same fingerprint, or never ran, runs: the stage's own resume keeps what it wrote (synth
  and capture append what is missing, train continues from its checkpoint);
- that finished, or was interrupted, with another fingerprint is refused in one line naming what changed, unless
  `--redo STAGE` asks for it: then its outputs are deleted and it runs from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hstap.errors import HstapError

STATE_NAME = "recipe.json"
HOW = {
    "prompts": ("device", "batch_size", "cuda_graphs"),
    "synth": ("servers", "concurrency", "timeout", "retries", "backoff", "device", "batch_size", "cuda_graphs",
              "continuous", "compile_step"),
    "capture": ("batch_tokens", "shard_mb", "commit_every", "force", "repair"),
    "train": ("checkpoint_every", "checkpoint_interval_s", "prefetch", "compile", "skip_bad_shards", "resume",
              "overwrite"),
    "eval": ("as_json",),
    "export": ("force",),
}
RESUMABLE = ("prompts", "synth", "capture", "train")  # eval and export start over every time they run


@dataclass(frozen=True)
class Action:
    kind: str  # "skip" | "run" | "redo"
    note: str = ""


def settings_of(stage: str, config) -> dict:
    """The config's values that decide what the stage makes (JSON types)."""
    values = config.model_dump(mode="json")
    return {k: v for k, v in values.items() if k not in HOW.get(stage, ())}


def fingerprint(values: dict, upstream: str | None) -> str:
    text = json.dumps({"settings": values, "input": upstream}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def changed_fields(stage: str, old: dict, new: dict, shown: int = 3) -> str:
    """`synth.max_new_tokens 256 → 128, synth.temperature 0.0 → 0.7` ('' when nothing differs)."""
    names = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    text = ", ".join(f"{stage}.{k} {old.get(k, 'unset')} → {new.get(k, 'unset')}" for k in names[:shown])
    return text + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


class RecipeState:
    """OUT/recipe.json, read at start and rewritten (whole, atomically) whenever a stage starts or finishes."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / STATE_NAME
        self.stages: dict[str, dict] = {}
        if self.path.exists():
            try:
                self.stages = json.loads(self.path.read_text())["stages"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise HstapError(f"{self.path}: not a recipe state file ({type(exc).__name__}); move it away to "
                                 "start the recipe afresh in this directory") from None

    def started(self, stage: str, fp: str, values: dict) -> None:
        self.stages[stage] = {"fingerprint": fp, "settings": values,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "finished": None}
        self.save()

    def finished(self, stage: str, seconds: float) -> None:
        self.stages[stage].update(finished=time.strftime("%Y-%m-%dT%H:%M:%S"), seconds=round(seconds, 1))
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATE_NAME}.tmp")
        tmp.write_text(json.dumps({"recipe_state": 1, "stages": self.stages}, indent=2) + "\n")
        os.replace(tmp, self.path)


def decide(stage: str, record: dict | None, fp: str, why_changed: Callable[[], tuple[str, str]], redo: bool,
           where: Path) -> Action:
    """What `stage` does on this run, from its record; a changed stage without `redo` is refused in one line.
    `why_changed()`: what differs from the record, in words, and the stage whose settings changed (asked only when
    the fingerprints differ)."""
    if redo:
        return Action("redo", "--redo: its outputs are deleted first")
    if record is None:
        return Action("run")
    if record["fingerprint"] == fp:
        return Action("skip", "finished earlier with the same settings") if record["finished"] else \
            Action("run", "continues the interrupted run")
    why, changed = why_changed()
    if record["finished"]:
        raise HstapError(f"{where}: {stage} finished earlier with other settings ({why}): pass --redo {changed} to "
                         f"run {changed} and the stages after it again from scratch, or put the settings back")
    if stage in RESUMABLE:
        raise HstapError(f"{where}: {stage} was interrupted with other settings ({why}): pass --redo {changed} to "
                         "start afresh, or put the settings back to continue it")
    return Action("run")
