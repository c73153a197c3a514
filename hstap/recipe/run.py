"""Run a recipe: decide online or store, check every stage against OUT/recipe.json, then run the stages in order.

    from hstap.recipe.config import load_recipe
    from hstap.recipe.run import run_recipe
    result = run_recipe(load_recipe("smollm2-smoke", flags={"out": "runs/smoke"}))   # RecipeResult

Every stage is checked before the first one runs, so a changed finished stage is refused in one line at once,
not after an hour of synth. Each stage prints a header (`── synth ───`) and its own summary; a stage that is not
run says why in one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from hstap.errors import HstapError
from hstap.recipe.config import STAGES, Recipe, build_configs
from hstap.recipe.memory import TrainingChoice, choose_training
from hstap.recipe.state import Action, RecipeState, changed_fields, decide, fingerprint, settings_of


@dataclass
class RecipePlan:
    """What a run will do: every stage's config, what it reads, its fingerprint and its action."""

    recipe: Recipe
    training: TrainingChoice
    configs: dict[str, BaseModel | None]
    upstream: dict[str, str | None]
    values: dict[str, dict]
    fingerprints: dict[str, str]
    actions: dict[str, Action]
    state: RecipeState


@dataclass
class RecipeResult:
    out: Path
    training: TrainingChoice
    results: dict[str, object] = field(default_factory=dict)  # stage -> what its entry point returned
    seconds: dict[str, float] = field(default_factory=dict)
    actions: dict[str, Action] = field(default_factory=dict)


def upstream_of(configs: dict, training: str) -> dict[str, str | None]:
    """The stage whose output each stage reads, where it reads the recipe's own (a file can point a stage elsewhere,
    e.g. `synth: {data: sharegpt}`: then synth reads no stage)."""
    p, s, c, t = (configs[k] for k in ("prompts", "synth", "capture", "train"))
    reads_train = {stage: "train" if Path(configs[stage].drafter) == Path(t.out) else None
                   for stage in ("eval", "export")}
    if training == "online":
        train_reads = "synth" if t.data == f"jsonl:{s.out}" else None
    else:
        train_reads = "capture" if Path(t.store) == Path(c.out) else None
    return {"prompts": None, "synth": "prompts" if s.data == f"jsonl:{p.out}" else None,
            "capture": "synth" if c.data == f"jsonl:{s.out}" else None, "train": train_reads, **reads_train}


def decide_training(recipe: Recipe, state: RecipeState) -> TrainingChoice:
    """The recipe's training mode; `auto` keeps the mode an earlier run of this recipe trained with (free memory
    differs from run to run), else estimates it (hstap.recipe.memory)."""
    s = recipe.settings
    record = state.stages.get("train")
    if s.training == "auto" and record and "train" not in recipe.redo:
        mode = "online" if record["settings"].get("online") else "store"
        return TrainingChoice(mode, f"auto: as the run recorded in {state.path} trained")
    if s.training != "auto" or not s.device.startswith("cuda"):
        return choose_training(s.training, s.device)
    from hstap.models.target import model_config, resolve_model_dir
    from hstap.preflight import check_device
    from hstap.recipe.memory import dense_parameters, free_memory, online_bytes, safetensors_parameters

    check_device(s.device, flag="recipe.device")  # before asking it for its free memory
    config = model_config(s.model)
    params = safetensors_parameters(resolve_model_dir(s.model)[0]) or dense_parameters(config)
    train = build_configs(recipe, "online")["train"].sized_for_device()
    need = online_bytes(config, params, min(train.draft_vocab, config["vocab_size"]), train.ttt_steps,
                        train.batch_tokens)
    return choose_training("auto", s.device, need, free_memory(s.device))


def plan_recipe(recipe: Recipe, strict: bool = True) -> RecipePlan:
    """Decide every selected stage's action; raises the one-line refusal of the first changed stage (`strict`), or
    records it as the stage's action (`--plan` shows them all)."""
    state = RecipeState(Path(recipe.settings.out))
    training = decide_training(recipe, state)
    configs = build_configs(recipe, training.mode)
    upstream = upstream_of(configs, training.mode)
    values, fingerprints = {}, {}
    for stage in STAGES:
        values[stage] = settings_of(stage, configs[stage])
        fingerprints[stage] = fingerprint(values[stage], fingerprints.get(upstream[stage] or ""))
    redo = set(recipe.redo)
    for stage in STAGES:  # redoing a stage redoes the selected stages that read its output
        if upstream[stage] in redo and stage in recipe.settings.stages:
            redo.add(stage)
    plan = RecipePlan(recipe, training, configs, upstream, values, fingerprints, {}, state)
    for stage in (name for name in STAGES if name in recipe.settings.stages):  # in the stages' order, not the flag's
        try:
            plan.actions[stage] = _action(plan, stage, stage in redo)
        except HstapError as exc:
            if strict:
                raise
            plan.actions[stage] = Action("refused", str(exc))
    return plan


def _action(plan: RecipePlan, stage: str, redo: bool) -> Action:
    if stage == "capture" and plan.training.mode == "online":
        return Action("skip", "online training — the target runs inside training, nothing is stored")
    if stage == "prompts" and plan.upstream["synth"] != "prompts":
        return Action("skip", f"synth reads {plan.configs['synth'].data}, not the recipe's prompts")
    record = plan.state.stages.get(stage)
    return decide(stage, record, plan.fingerprints[stage], lambda: _why_changed(plan, stage), redo, plan.state.path)


def _why_changed(plan: RecipePlan, stage: str) -> tuple[str, str]:
    """What differs from the recorded run of `stage`, and where: its own settings, else those of the nearest stage
    upstream whose settings changed."""
    at = stage
    while at is not None:
        record = plan.state.stages.get(at)
        own = changed_fields(at, record["settings"], plan.values[at]) if record else ""
        if own:
            return (own, at) if at == stage else (f"it read the output of {at}, whose settings changed: {own}", at)
        at = plan.upstream[at]
    return "an earlier stage's output it read was made with other settings", stage


def header(name: str) -> None:
    print(f"\n── {name} " + "─" * (60 - len(name)), flush=True)


def run_recipe(recipe: Recipe) -> RecipeResult:
    """Run the selected stages in order; each finished stage is recorded in OUT/recipe.json at once."""
    from hstap.recipe.stages import STAGE_RUNNERS, SharedTarget, clear_outputs

    plan = plan_recipe(recipe)
    if {"capture", "train"} & set(plan.actions):
        print(f"hstap recipe: {plan.training.line()}", flush=True)
    result = RecipeResult(Path(recipe.settings.out), plan.training, actions=plan.actions)
    shared = SharedTarget()
    try:
        for stage, action in plan.actions.items():
            if action.kind == "skip":
                print(f"\n── {stage}: {action.note}: skipped", flush=True)
                continue
            header(stage)
            if action.note:
                print(f"{stage}: {action.note}", flush=True)
            if action.kind == "redo":
                clear_outputs(stage, plan.configs, recipe.settings.out)
            plan.state.started(stage, plan.fingerprints[stage], plan.values[stage])
            start = time.perf_counter()
            done = STAGE_RUNNERS[stage](plan.configs, shared, fresh=action.kind == "redo")
            result.seconds[stage] = time.perf_counter() - start
            plan.state.finished(stage, result.seconds[stage])
            result.results[stage] = done
            if hasattr(done, "summary"):
                print(done.summary(), flush=True)
    finally:
        shared.release()
    return result
