"""`hstap recipe`: flags and a recipe file → Recipe → run_recipe (hstap/recipe/run.py).

    hstap recipe --config smollm2-cpu --out runs/cpu
    hstap recipe --config llama.yaml --set train.time_budget_s=2h --redo train --plan

Unlike the other commands, the recipe reads every section of its file (`config_from_args` below, which hstap.cli
calls instead of hstap.config's one-section reader); its own flags are the `recipe:` section's fields, `--redo`,
and `--set` for any section.
"""

from __future__ import annotations

import yaml

from hstap.config import add_config_flags
from hstap.errors import HstapError
from hstap.recipe.config import SHIPPED, Recipe, RecipeSettings, comma_separated, load_recipe


def add_arguments(parser) -> None:
    add_config_flags(parser, RecipeSettings, "recipe")
    shipped = ", ".join(p.stem for p in sorted(SHIPPED.glob("*.yaml")))
    helps = {"config": ("FILE.yaml|NAME", f"the recipe: a YAML file, or a shipped recipe's name ({shipped}); flags "
                                          "override its recipe: section"),
             "overrides": ("SECTION.FIELD=VALUE", "override one setting of any section, e.g. train.lr=3e-4 "
                                                  "(repeatable; applied last)"),
             "plan": (None, "print the resolved recipe (every section, the training mode, what each stage will do) "
                            "and exit")}
    for action in parser._actions:  # add_config_flags words them for one section
        if action.dest in helps:
            metavar, action.help = helps[action.dest]
            action.metavar = metavar or action.metavar
    parser.add_argument("--redo", default="", metavar="STAGE,...",
                        help="run these finished stages again from scratch (their outputs deleted first), and the "
                             "stages after them that read their output")


def config_from_args(args) -> Recipe:
    """The recipe from the file, the `recipe:` flags given, `--set` and `--redo`."""
    flags = {name: value for name, value in vars(args).items() if name in RecipeSettings.model_fields}
    try:
        redo = comma_separated(args.redo) if args.redo else []
    except ValueError as exc:
        raise HstapError(f"--redo {args.redo}: {exc}") from None
    return load_recipe(args.config, flags, args.overrides, redo)


def plan(recipe: Recipe) -> str:
    """Every section resolved (a valid recipe file), then the training mode and each stage's action as comments."""
    from hstap.recipe.run import plan_recipe

    p = plan_recipe(recipe, strict=False)
    doc = {"recipe": recipe.settings.model_dump(mode="json")}
    for name, cfg in p.configs.items():
        if cfg is None:
            continue
        values = cfg.resolved() if name in ("capture", "train") else cfg.model_dump(mode="json")
        if name == "train":  # the training mode sets them
            values = {k: v for k, v in values.items() if k not in ("online", "store")}
        doc[name] = values
    notes = [f"# {p.training.line()}"]
    for stage, action in p.actions.items():
        notes.append(f"# {stage}: {action.kind}" + (f" ({action.note})" if action.note else ""))
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=118) + "\n".join(notes) + "\n"


def run(recipe: Recipe) -> int:
    from hstap.recipe.run import run_recipe

    result = run_recipe(recipe)
    ran = ", ".join(f"{stage} {seconds:.0f}s" for stage, seconds in result.seconds.items()) or "nothing to do"
    print(f"\nhstap recipe: {ran}; everything is in {result.out} (stages recorded in {result.out / 'recipe.json'})")
    return 0
