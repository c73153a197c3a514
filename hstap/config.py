"""One source of configuration: every command's flags are generated from its pydantic config.

    hstap train --store runs/cap --out runs/d --lr 3e-4 --plan          # flags named like the fields
    hstap train --config run.yaml --set train.lr=3e-4 --out runs/d      # a YAML file plus dotted overrides

A config field is declared once, with `option(default, help, ...)`: its default, help text, choices (`Literal`)
and bounds live there and nowhere else, so a default cannot be written twice. Values are taken in this order,
later ones winning: the field's default, the command's section of `--config FILE.yaml` (`train: {lr: 3e-4}`),
the flags given on the command line, then `--set SECTION.FIELD=VALUE`. An unknown section, field or dotted path
is refused with the list of valid ones; a value out of bounds names its dotted path and its flag.

`--plan` prints the resolved config as YAML (a config's `resolved()` turns `layers: auto` into `[1, 14, 26]`)
and exits: the output is itself a valid `--config` file.

The shared vocabulary lives here too: storage dtypes are spelled `bf16`, `fp16`, `fp32` (and `fp8` for stored
hidden states) everywhere, and the
teacher signal of a store is one `TeacherSpec` in capture, store and train. Importing this module is cheap (no
torch): `hstap --help` builds every parser from it.
"""

from __future__ import annotations

import argparse
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticUndefined

from hstap.errors import HstapError

Dtype = Literal["bf16", "fp16", "fp32"]  # what a model computes in (eval, export)
# What captured hidden states are stored in: the compute dtypes, or `fp8` = float8 e4m3 with one fp32 scale per token
# and layer (hstap.store.fp8). Only a store holds fp8; a model never computes in it here.
StoreDtype = Literal["bf16", "fp16", "fp32", "fp8"]
Loops = Literal["keep", "cut"]  # answers ending in a repetition loop (hstap/data/loops.py)
LOOPS_HELP = ("answers that end in a repetition loop: keep them whole, or cut them after the loop's first repeat "
              "(the rest out of the loss)")
LEGACY_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # stores written before 2026-12
TENSOR_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int64", "int32", "int16", "uint8", "bool")


def device_text(value: Any) -> Any:
    """The spelling of a device flag, checked when the config validates (no torch import): `cpu`, `cuda` or
    `cuda:N`. Whether that device is here is `hstap.preflight.check_device`'s question, asked at run time."""
    if isinstance(value, str) and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ValueError(f"expected cpu, cuda or cuda:N, got {value!r}")
    return value


Device = Annotated[str, BeforeValidator(device_text)]  # every command's --device


def torch_dtype(name: str):
    """`bf16` → `torch.bfloat16` (also the manifest spellings `int32`, `bool`, and legacy `bfloat16`)."""
    import torch

    name = LEGACY_DTYPES.get(name, name)
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
             "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8, "bool": torch.bool}
    if name not in table:
        raise HstapError(f"unknown dtype {name!r}: expected one of {', '.join(TENSOR_DTYPES)}")
    return table[name]


def torch_name(name: str) -> str:
    """`bf16` → `bfloat16`: the spelling transformers' config.json files use (exports write it)."""
    return {short: long for long, short in LEGACY_DTYPES.items()}.get(name, name)


def rounding_step(name: str) -> float:
    """The relative spacing of a dtype's values near 1 (2**-mantissa_bits): two computations of the same value
    that round differently may differ by this much, relatively. The one rule every comparison of stored tensors
    (`hstap compare`, the tests) uses: fp16 gets 9.8e-4, bf16 7.8e-3, fp32 1.2e-7, fp8 (e4m3, 3 mantissa bits)
    0.125. The per-token cosine follows from it: values that differ by at most a relative `step` have a cosine of
    at least 1 - step**2 / 2 (`cosine_floor`).

    fp8 is scaled per token (amax / 448, hstap.store.fp8), so every element but the ones under 2**-9 of the row's
    largest (fp8's subnormals, which carry almost none of the row's norm) rounds to within half this step. Measured
    on 96 SmolLM2 conversations (docs/benchmarks.md): an fp8 store is at most 0.023 from the bf16 one (relative
    norm per sample), per-token cosine ≥ 0.9995."""
    bits = {"fp32": 23, "fp16": 10, "bf16": 7, "fp8": 3}
    name = LEGACY_DTYPES.get(name, name)
    if name not in bits:
        raise HstapError(f"no rounding step for dtype {name!r}: expected one of {', '.join(bits)}")
    return 2.0 ** -bits[name]


def cosine_floor(name: str) -> float:
    """The lowest per-token cosine similarity two copies of one value may have when they differ by the dtype's
    rounding step (relative): 1 - step**2 / 2, the small-angle cosine of a relative perturbation of that size. bf16
    and finer give > 0.99996, so a comparison's own `--min-cos` (0.999) decides; fp8 gives 0.992."""
    return 1.0 - rounding_step(name) ** 2 / 2


def dtype_name(dtype) -> str:
    """`torch.bfloat16` → `bf16`: the one spelling configs, manifests and reports use."""
    name = str(dtype).removeprefix("torch.")
    return "fp8" if name == "float8_e4m3fn" else LEGACY_DTYPES.get(name, name)


class TeacherSpec(BaseModel):
    """What the trainer learns from. `topk`: the target's top-k log-probs per token (k int32 ids + k fp16 values);
    `hidden`: the final normed hidden state (H values per token; the trainer applies the target's lm_head).

    Written as `topk:32` or `hidden` on the command line and in YAML; stored as `{kind, k}` in manifests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["topk", "hidden"] = "topk"
    k: int = Field(default=32, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if isinstance(value, TeacherSpec):
            return value
        if isinstance(value, str):
            if value == "hidden":
                return {"kind": "hidden", "k": 0}
            match = re.fullmatch(r"topk:(\d+)", value)
            if match and int(match[1]) > 0:
                return {"kind": "topk", "k": int(match[1])}
            raise ValueError(f"expected 'topk:K' (e.g. topk:32) or 'hidden', got {value!r}")
        if isinstance(value, dict) and value.get("kind") == "hidden":
            return {"kind": "hidden", "k": 0}
        return value

    @classmethod
    def parse(cls, text: str) -> "TeacherSpec":
        try:
            return cls.model_validate(text)
        except ValidationError as exc:
            raise HstapError(f"--teacher: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None

    def __str__(self) -> str:
        return f"topk:{self.k}" if self.kind == "topk" else "hidden"

    def to_dict(self) -> dict:
        return {"kind": "topk", "k": self.k} if self.kind == "topk" else {"kind": "hidden"}


def parse_duration(value: Any) -> Any:
    """'90', '90s', '8m', '1.5h' → seconds; numbers pass through (a pydantic before-validator)."""
    if not isinstance(value, str):
        return value
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        return float(value[:-1]) * units[value[-1]] if value and value[-1] in units else float(value)
    except ValueError:
        raise ValueError(f"expected a duration like 90s, 8m or 1h, got {value!r}") from None


def option(default: Any = PydanticUndefined, help: str = "", *, flag: str | None = None,
           metavar: str | None = None, positional: bool = False, cli: bool = True, several: bool = False,
           **field_kwargs) -> Any:
    """A config field with its command-line form: `--name-with-dashes` unless `flag` says otherwise.

    `positional`: a positional argument; a positional list takes the rest of the line (an engine's own flags),
    or with `several` one or more values, flags allowed before and after them. `cli=False`: settable from
    YAML/--set only (or by the program)."""
    extra = {"flag": flag, "metavar": metavar, "positional": positional, "cli": cli, "several": several}
    return Field(default, description=help, json_schema_extra={"cli": extra}, **field_kwargs)


def _cli_meta(info) -> dict:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("cli", {"cli": True, "positional": False})


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """`X | None` → (X, True); anything else → (annotation, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _default_of(info) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()
    return PydanticUndefined


def _help(info) -> str:
    text = info.description or ""
    default = _default_of(info)
    if default is PydanticUndefined:
        return f"{text} (required)".strip()
    if default in (None, False, []) or isinstance(default, bool):
        return text
    shown = str(default) if not isinstance(default, float) else f"{default:g}"
    return f"{text} (default: {shown})".strip()


def flag_of(cls: type[BaseModel], name: str) -> str:
    """The command-line spelling of field `name`."""
    meta = _cli_meta(cls.model_fields[name])
    return meta.get("flag") or ("--" + name.replace("_", "-") if not meta.get("positional") else name)


def add_config_flags(parser: argparse.ArgumentParser, cls: type[BaseModel], section: str) -> None:
    """Flags for every field of `cls`, plus `--config`, `--set` and `--plan`. Flags default to absent (SUPPRESS),
    so a config built from them takes its defaults from `cls` alone; values stay text until the config validates
    them, so `--time-budget 8m` and `time_budget_s: 8m` in a YAML file go through the same parser."""
    for name, info in cls.model_fields.items():
        meta = _cli_meta(info)
        if not meta.get("cli", True):
            continue
        annotation, _ = _unwrap(info.annotation)
        kwargs: dict[str, Any] = {"help": _help(info)}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("positional"):
            if get_origin(annotation) is list:
                kwargs["nargs"] = "+" if meta.get("several") else argparse.REMAINDER
            parser.add_argument(name, **kwargs)
            continue
        kwargs.update(dest=name, default=argparse.SUPPRESS)
        if get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        elif annotation is bool:
            kwargs["action"] = "store_true" if _default_of(info) is False else argparse.BooleanOptionalAction
        elif get_origin(annotation) is list:
            kwargs["action"] = "append"
        parser.add_argument(flag_of(cls, name), **kwargs)
    parser.add_argument("--config", type=Path, default=None, metavar="FILE.yaml",
                        help=f"read settings from the file's '{section}:' section (flags override it)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar=f"{section}.FIELD=VALUE",
                        help="override one setting (repeatable; applied last)")
    parser.add_argument("--plan", action="store_true", help="print the resolved config as YAML and exit")
    parser.set_defaults(config_section=section, config_cls=cls)


def _read_section(path: Path, section: str, sections: list[str]) -> dict:
    import yaml

    try:
        raw = path.read_bytes()
        data = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as exc:  # a UTF-16 file (starts 0xff 0xfe), Latin-1, a binary file
        raise HstapError(f"--config {path}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1}); save the "
                         "file as UTF-8 YAML") from None
    except (OSError, yaml.YAMLError) as exc:
        raise HstapError(f"--config {path}: not a readable YAML file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise HstapError(f"--config {path}: expected a mapping of sections ({', '.join(sections)})")
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise HstapError(f"--config {path}: unknown section {unknown[0]!r}; valid sections: {', '.join(sections)}")
    values = data.get(section) or {}
    if not isinstance(values, dict):
        raise HstapError(f"--config {path}: section '{section}' must be a mapping of field: value")
    return values


def _apply_overrides(values: dict, overrides: list[str], cls: type[BaseModel], section: str) -> None:
    import yaml

    valid = [f"{section}.{name}" for name in cls.model_fields]
    for item in overrides:
        path, eq, text = item.partition("=")
        if not eq:
            raise HstapError(f"--set {item!r}: expected {section}.FIELD=VALUE, e.g. {valid[0]}=...")
        if path not in valid:
            raise HstapError(f"--set {path}: unknown setting; valid: {', '.join(valid)}")
        try:
            values[path.split(".", 1)[1]] = yaml.safe_load(text)
        except yaml.YAMLError:
            values[path.split(".", 1)[1]] = text


def config_from_args(args: argparse.Namespace, sections: list[str] | None = None, **fields) -> BaseModel:
    """The command's config: field defaults < `--config` section < flags < `--set` (and `fields`, set by the
    program). Validation errors name the dotted path and the flag."""
    cls, section = args.config_cls, args.config_section
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(_read_section(args.config, section, sections or [section]))
    values.update({k: v for k, v in vars(args).items() if k in cls.model_fields})
    _apply_overrides(values, args.overrides, cls, section)
    _check_scalar_types(values, cls, section)  # flags are text (parsed later); YAML and --set give typed values
    values.update(fields)
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise HstapError(describe_validation_error(exc, cls, section)) from None


def _check_scalar_types(values: dict, cls: type[BaseModel], section: str) -> None:
    """A YAML boolean for a number field (`limit: true`), or a number for a switch (`force: 1`), is refused naming
    the dotted path: pydantic's lax mode would read `true` as 1. Text is left to the field's own parsing, so a flag's
    `--limit 5` (always text) and `limit: "5"` still work."""
    for name, value in values.items():
        info = cls.model_fields.get(name)
        if info is None or value is None:
            continue
        annotation, _ = _unwrap(info.annotation)
        number = annotation in (int, float)
        if (number and isinstance(value, bool)) or (annotation is bool and isinstance(value, (int, float))
                                                     and not isinstance(value, bool)):
            flag = f" ({flag_of(cls, name)})" if _cli_meta(info).get("cli", True) else ""
            expected = "true or false" if annotation is bool else "an integer" if annotation is int else "a number"
            got = f"the YAML boolean {str(value).lower()}" if isinstance(value, bool) else f"the YAML number {value}"
            raise HstapError(f"{section}.{name}{flag}: expected {expected}, got {got}")


def describe_validation_error(exc: ValidationError, cls: type[BaseModel], section: str) -> str:
    """One line: the first problem, its dotted path and flag, and how many more there are."""
    errors = exc.errors()
    err = errors[0]
    loc = [str(p) for p in err["loc"]]
    where = ".".join([section, *loc])
    if loc and loc[0] in cls.model_fields and _cli_meta(cls.model_fields[loc[0]]).get("cli", True):
        where += f" ({flag_of(cls, loc[0])})"
    if err["type"] == "missing":
        msg = "required"
    elif err["type"] == "extra_forbidden":
        msg = f"unknown field; valid: {', '.join(cls.model_fields)}"
    else:
        shown = "input" in err and loc  # a check of the whole config would show every field as its input
        msg = err["msg"].removeprefix("Value error, ") + (f" (got {err['input']!r})" if shown else "")
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {msg}{more}"


def plan_text(cfg: BaseModel, section: str) -> str:
    """The resolved config as a `--config` YAML document: `section: {field: value}`."""
    import yaml

    resolved = cfg.resolved() if hasattr(cfg, "resolved") else cfg.model_dump(mode="json")
    return yaml.safe_dump({section: resolved}, sort_keys=False, default_flow_style=None, width=118)
