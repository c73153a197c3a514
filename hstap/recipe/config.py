"""A recipe file: a small `recipe:` section plus the stage configs as sections, the paths between stages filled in.

    recipe:  {model: /ckpt/Llama-3.1-8B-Instruct, device: cuda, out: runs/llama, engine: sglang, training: auto}
    prompts: {total: 20000}             # PromptsConfig (hstap prompts)
    synth:   {concurrency: 64}          # SynthConfig (hstap synth)
    serve:   {engine: sglang}           # ServeConfig (hstap serve): the engine the recipe starts for synth
    capture: {}                         # CaptureConfig (hstap capture): store training only
    train:   {time_budget_s: 2h}        # TrainConfig (hstap train)
    eval:    {limit: 80}                # EvalConfig (hstap eval)
    export:  {}                         # ExportConfig (hstap export)

Each stage section is validated by the stage's own pydantic config, over the recipe's defaults: the outputs go to
OUT/prompts.jsonl, OUT/synth.jsonl, OUT/store, OUT/drafter, OUT/eval and OUT/export-ENGINE, each stage reads the
one before it, and the measured choices (docs/recipe.md) fill what the file leaves out, so a file only says what
differs. Values are taken in this order, later ones winning: the recipe's defaults, the file, the command's flags
(the `recipe:` fields only), then `--set SECTION.FIELD=VALUE`. A shipped recipe is found by its name
(`--config smollm2-gpu`: hstap/recipe/recipes/). Light on purpose (no torch): `--plan` and the errors need no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from hstap.config import Device, option
from hstap.errors import HstapError

STAGES = ("prompts", "synth", "capture", "train", "eval", "export")
SECTIONS = ("recipe", "prompts", "synth", "serve", "capture", "train", "eval", "export")
SHIPPED = Path(__file__).resolve().parent / "recipes"
# The measured choices (docs/data.md, docs/benchmarks.md): Magpie weighted up, as the source that keeps giving new
# prompts; greedy answers capped at 256 tokens (as good a drafter as 384 at equal steps, 22 % more prompts a
# second); the shapes MT-bench is read with.
DEFAULT_SOURCES = ("sharegpt:3", "magpie:12", "code:5")
DEFAULT_PROMPTS = 12000
ANSWER_CAP = 256
DEFAULT_SHAPES = {"ngram": [3], "chain": [3], "tree": ["8,8,60"], "hybrid": ["4,2"]}
GPU_BATCH = 256  # rows per decode batch of Magpie and embedded synth on a GPU
GPU_TRAIN = {"epochs": 40, "time_budget_s": 3600}  # online on a GPU: as many epochs as an hour holds
TRAINING_FIELDS = ("online", "store")  # the recipe's `training` decides them


def comma_separated(value) -> list[str]:
    """`"eval,export"` or `["eval", "export"]` → `["eval", "export"]`, each a stage name."""
    if isinstance(value, str):
        value = [value]
    names = [name.strip() for item in value for name in str(item).split(",") if name.strip()]
    if sorted(set(names) - set(STAGES)) or not names:
        raise ValueError(f"expected a comma-separated subset of {','.join(STAGES)}")
    return names


class RecipeSettings(BaseModel):
    """The `recipe:` section: the target, where it runs, where everything goes, and what to run."""

    model_config = ConfigDict(extra="forbid")

    model: str = option("smollm2", "the target: 'smollm2' or a checkpoint dir (its tokenizer and config are read "
                                   "even when a server answers synth)")
    device: Device = option("cpu", "cpu | cuda | cuda:N, for every stage that runs the target here")
    out: Path = option(Path("runs/recipe"), "run directory: every stage's output and recipe.json")
    stages: list[str] = option(list(STAGES), "comma-separated subset of " + ",".join(STAGES) + "; the others are "
                                             "left as they are", metavar="STAGE,...")
    engine: Literal["sglang", "vllm"] = option("sglang", "the engine the drafter is exported for")
    training: Literal["auto", "online", "store"] = option(
        "auto", "online (the target runs inside training), store (capture, then train from it), or auto: online "
                "where both fit the device's free memory, store on a CPU")
    server: str | None = option(None, "synth through this running OpenAI-compatible server (SGLang, vLLM) "
                                      "instead of the embedded target", metavar="URL")

    @field_validator("stages", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return comma_separated(value)


@dataclass
class Recipe:
    """A recipe as given: its settings, each stage section's values (file, then --set), and where each came from."""

    settings: RecipeSettings
    sections: dict[str, dict]
    source: Path | None = None  # the recipe file
    set_paths: set[str] = field(default_factory=set)  # "section.field" given by --set
    flag_paths: set[str] = field(default_factory=set)  # "recipe.field" given by a flag
    redo: list[str] = field(default_factory=list)

    def where(self, path: str) -> str:
        """Who gave the value at dotted `path`, as the start of a one-line error."""
        if path in self.set_paths:
            return f"--set {path}"
        if path in self.flag_paths:
            return f"{path} (--{path.split('.', 1)[1].replace('_', '-')})"
        return f"--config {self.source}: {path}" if self.source else path


def find_recipe(text: str | Path) -> Path:
    """A recipe file: the path given, or the shipped recipe of that name (`smollm2-gpu`)."""
    path = Path(text)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return path
    shipped = SHIPPED / f"{path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(p.stem for p in sorted(SHIPPED.glob("*.yaml")))
    raise HstapError(f"--config {text}: no such file, nor a shipped recipe of that name (shipped: {names})")


def read_sections(path: Path) -> dict[str, dict]:
    """The file's sections, each a mapping; an unknown section is refused naming the file and the valid ones."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise HstapError(f"--config {path}: not UTF-8; save the file as UTF-8 YAML") from None
    except (OSError, yaml.YAMLError) as exc:
        raise HstapError(f"--config {path}: not a readable YAML file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise HstapError(f"--config {path}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for name, values in data.items():
        if name not in SECTIONS:
            raise HstapError(f"--config {path}: unknown section {name!r}; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict) and values is not None:
            raise HstapError(f"--config {path}: section '{name}' must be a mapping of field: value")
    return {name: dict(values or {}) for name, values in data.items()}


def apply_sets(sections: dict[str, dict], sets: list[str]) -> set[str]:
    """`--set SECTION.FIELD=VALUE` into `sections` (the value read as YAML); returns the dotted paths set."""
    import yaml

    paths = set()
    for item in sets:
        path, eq, text = item.partition("=")
        section, dot, name = path.partition(".")
        if not eq or not dot or not name:
            raise HstapError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. train.lr=3e-4")
        if section not in SECTIONS:
            raise HstapError(f"--set {path}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        sections.setdefault(section, {})[name] = value
        paths.add(path)
    return paths


def load_recipe(config: str | Path | None, flags: dict | None = None, sets: list[str] = (),
                redo: list[str] = ()) -> Recipe:
    """The recipe of file `config` (or only the defaults), with `flags` over its `recipe:` section and `sets` over
    everything; every section checked now, so a wrong field is one line before anything runs."""
    source = find_recipe(config) if config is not None else None
    sections = read_sections(source) if source is not None else {}
    settings_values = {**sections.pop("recipe", {}), **(flags or {})}
    recipe = Recipe(RecipeSettings(), sections, source, flag_paths={f"recipe.{k}" for k in flags or {}})
    sections["recipe"] = settings_values
    recipe.set_paths = apply_sets(sections, list(sets))
    recipe.settings = validated(recipe, "recipe", RecipeSettings, sections.pop("recipe"))
    unknown = sorted(set(redo) - set(recipe.settings.stages))
    if unknown:
        raise HstapError(f"--redo {unknown[0]}: not among the stages that run ({','.join(recipe.settings.stages)})")
    recipe.redo = list(redo)
    build_configs(recipe, training="store" if recipe.settings.training == "auto" else recipe.settings.training)
    return recipe


def validated(recipe: Recipe, section: str, cls: type[BaseModel], values: dict) -> BaseModel:
    """`cls` from `values`; the first problem as one line naming who gave the value (file, flag or --set)."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = [str(p) for p in err["loc"]]
        path = ".".join([section, *loc])
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; valid: {', '.join(cls.model_fields)}"
        elif err["type"] == "missing":
            msg = "required"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            msg += f" (got {err['input']!r})" if loc and repr(err["input"]) not in msg else ""
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise HstapError(f"{recipe.where(path)}: {msg}{more}") from None


def serve_url(serve) -> str:
    host = "127.0.0.1" if serve.host in ("0.0.0.0", "::") else serve.host
    return f"http://{host}:{serve.port}"


def build_configs(recipe: Recipe, training: str) -> dict[str, BaseModel | None]:
    """Every stage's config for `training` (online or store): the recipe's defaults, then the file's and --set's
    values. `serve` is None when the recipe starts no engine."""
    from hstap.capture.config import CaptureConfig
    from hstap.data.config import PromptsConfig
    from hstap.evaluate.config import EvalConfig
    from hstap.export.config import ExportConfig
    from hstap.serve.config import ServeConfig
    from hstap.synth.config import SynthConfig
    from hstap.train.config import TrainConfig

    s, given = recipe.settings, recipe.sections
    out, cuda = Path(s.out), s.device.startswith("cuda")
    gpu = {"batch_size": GPU_BATCH} if cuda else {}

    def stage(name: str, cls: type[BaseModel], defaults: dict) -> BaseModel:
        return validated(recipe, name, cls, {**defaults, **given.get(name, {})})

    configs: dict[str, BaseModel | None] = {}
    configs["prompts"] = prompts = stage("prompts", PromptsConfig, {
        "out": out / "prompts.jsonl", "sources": list(DEFAULT_SOURCES), "total": DEFAULT_PROMPTS, "model": s.model,
        "device": s.device, **gpu})
    configs["serve"] = serve = _serve(recipe, stage, ServeConfig)
    servers = [s.server] if s.server else [serve_url(serve)] if serve else []
    configs["synth"] = synth = stage("synth", SynthConfig, {
        "model": None if servers else s.model, "servers": servers, "data": f"jsonl:{prompts.out}",
        "out": out / "synth.jsonl", "max_new_tokens": ANSWER_CAP, "device": s.device, **gpu})
    configs["capture"] = capture = stage("capture", CaptureConfig, {
        "model": s.model, "data": f"jsonl:{synth.out}", "out": out / "store", "device": s.device})
    for name in TRAINING_FIELDS:
        if name in given.get("train", {}):
            raise HstapError(f"{recipe.where('train.' + name)}: set by the recipe's training mode; set "
                             "recipe.training (auto | online | store) instead")
    source = {"online": True, "data": f"jsonl:{synth.out}"} if training == "online" else {"store": capture.out}
    configs["train"] = train = stage("train", TrainConfig, {
        "model": s.model, "out": out / "drafter", "device": s.device, **source, **(GPU_TRAIN if cuda else {})})
    configs["eval"] = stage("eval", EvalConfig, {
        "model": s.model, "drafter": train.out, "out": out / "eval", "bench": "mt-bench", **DEFAULT_SHAPES,
        "max_new_tokens": ANSWER_CAP, "device": s.device})
    fmt = given.get("export", {}).get("format") or s.engine
    configs["export"] = stage("export", ExportConfig, {"drafter": train.out, "format": fmt,
                                                       "out": out / f"export-{fmt}"})
    return configs


def _serve(recipe: Recipe, stage, cls: type[BaseModel]) -> BaseModel | None:
    """The engine the recipe starts for synth (the `serve:` section), or None."""
    if "serve" not in recipe.sections:
        return None
    if recipe.settings.server:
        if {"recipe.server"} & (recipe.flag_paths | recipe.set_paths):
            return None  # --server URL on the command line overrides the file's serve: section
        raise HstapError(f"{recipe.where('recipe.server')}: and a serve: section: give one, a server that is "
                         "already running (recipe.server) or the engine the recipe starts (serve:)")
    serve = stage("serve", cls, {"model": recipe.settings.model, "run_dir": Path(recipe.settings.out) / "serve"})
    if serve.capture_dir is not None:
        raise HstapError(f"{recipe.where('serve.capture_dir')}: the recipe serves the engine for synth only; capture "
                         "through a served engine by hand (docs/recipe.md), or let the recipe capture (training: "
                         "store)")
    return serve
