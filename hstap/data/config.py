"""PromptsConfig: everything `hstap prompts` depends on; `hstap prompts --plan` prints it with each source's quota.

Light on purpose (no torch, no numpy): `hstap --help` and `hstap prompts --plan` build it without loading a model.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from hstap.config import Device, option
from hstap.data.filters import FilterSettings

SOURCE_NAMES = ("sharegpt", "magpie", "code")
# Defaults `hstap prompts` shares with the library functions it calls (one home each)
NEAR_DUP = 0.7  # estimated word-pair Jaccard at which a prompt is a near duplicate: hstap.data.dedupe.Deduper
CODE_MIN_LINES, CODE_MAX_LINES = 5, 60  # lines of code a unit may have: hstap.data.code.stdlib_units
IDENTITY_FIELDS = ("seed", "sharegpt_continuations", "sharegpt_max_chars", "model", "temperature", "top_p",
                   "max_new_tokens", "near_dup", "filters", "code_tasks_per_unit", "code_packages", "code_min_lines", "code_max_lines")


class PromptsConfig(BaseModel):
    """Build `out` with `total` prompts mixed from `sources` (NAME:WEIGHT) by weight.

    The fields in IDENTITY_FIELDS decide which prompts a run makes; a re-run on an existing file must keep them
    (checked against the provenance file), while `total`, `sources`, the device and the batch size may change.
    """

    model_config = ConfigDict(extra="forbid")

    out: Path = option(help="output FILE.jsonl (re-run to resume or to grow it)")
    sources: list[str] = option(default_factory=lambda: ["sharegpt:1", "magpie:1", "code:1"], flag="--source",
                                metavar="NAME:WEIGHT", help="a source and its mixing weight (repeatable; a bare "
                                                            f"NAME weighs 1): {', '.join(SOURCE_NAMES)}")
    total: int = option(help="prompts in the finished file, split over the sources by weight", ge=1)
    seed: int = option(0, "seed of every choice: ShareGPT order, code tasks, Magpie sampling")
    sharegpt_continuations: bool = option(True, "sharegpt: recover the chunks that start with an answer")
    sharegpt_max_chars: int | None = option(None, "sharegpt: pass over conversations whose first user turn is "
                                                  "longer (counted); default: no cap", ge=1)
    model: str = option("smollm2", "magpie: the target that writes the prompts ('smollm2' or a checkpoint dir)")
    device: Device = option("cpu", "magpie: cpu | cuda | cuda:N")
    batch_size: int = option(16, "magpie: prompts sampled per decode batch (sampling is reproducible for the "
                                 "same batch size and device)", ge=1)
    cuda_graphs: bool | None = option(None, "magpie: replay the decode step as a CUDA graph (default: on CUDA)")
    temperature: float = option(1.0, "magpie: sampling temperature", gt=0.0, le=2.0)
    top_p: float = option(0.99, "magpie: nucleus sampling mass", gt=0.0, le=1.0)
    max_new_tokens: int = option(256, "magpie: longest prompt in tokens (longer ones are dropped as unfinished)",
                                 ge=1)
    max_attempts: float = option(8.0, "magpie: stop after this many samples per requested prompt", gt=0.0)
    near_dup: float = option(NEAR_DUP, "sharegpt, magpie: estimated word-pair Jaccard at which a prompt is a near "
                                       "duplicate of one already kept", gt=0.0, le=1.0)
    filters: FilterSettings = option(default_factory=FilterSettings, cli=False,
                                     help="magpie: prompt rules (hstap/data/filters.py); set with --config or "
                                          "--set 'prompts.filters={min_chars: 20}'")
    code_tasks_per_unit: int = option(6, "code: distinct tasks per function or class (at most 6)", ge=1, le=6)
    code_packages: list[str] = option(default_factory=list, flag="--code-package", metavar="NAME",
                                      help="code: only this stdlib package or module (repeatable; all by default)")
    code_min_lines: int = option(CODE_MIN_LINES, "code: fewest lines of code in a unit (its docstring not counted)",
                                 ge=1)
    code_max_lines: int = option(CODE_MAX_LINES, "code: most lines of code in a unit", ge=1)

    @field_validator("sources")
    @classmethod
    def _sources(cls, value: list[str]) -> list[str]:
        names = [parse_source(item)[0] for item in value]
        if not names:
            raise ValueError(f"give at least one source: {', '.join(SOURCE_NAMES)}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"source {repeated[0]!r} given twice: give each source once, with its weight")
        return value

    @model_validator(mode="after")
    def _check(self) -> "PromptsConfig":
        if self.out.suffix != ".jsonl":
            raise ValueError(f"out {str(self.out)!r} must end in .jsonl (the provenance file goes beside it)")
        if self.code_min_lines > self.code_max_lines:
            raise ValueError(f"code_min_lines {self.code_min_lines} is above code_max_lines {self.code_max_lines}")
        return self

    def weights(self) -> dict[str, float]:
        """Source name -> weight, in the order given (the order the sources run in)."""
        return dict(parse_source(item) for item in self.sources)

    def quotas(self) -> dict[str, int]:
        """Prompts requested per source: `total` split by weight, remainders to the largest fractions (ties to
        the source given first), so the quotas always sum to `total`."""
        weights = self.weights()
        exact = {n: self.total * w / sum(weights.values()) for n, w in weights.items()}
        quotas = {n: math.floor(x) for n, x in exact.items()}
        for name in sorted(exact, key=lambda n: -(exact[n] - quotas[n]))[:self.total - sum(quotas.values())]:
            quotas[name] += 1
        return quotas

    def identity(self) -> dict:
        """The settings that decide which prompts are made (JSON types)."""
        dumped = self.model_dump(mode="json")
        return {name: dumped[name] for name in IDENTITY_FIELDS}

    def provenance_path(self) -> Path:
        return self.out.with_name(self.out.name + ".provenance.json")


def parse_source(item: str) -> tuple[str, float]:
    """'magpie:2' -> ('magpie', 2.0); a bare name weighs 1."""
    name, sep, weight = item.partition(":")
    if name not in SOURCE_NAMES:
        raise ValueError(f"unknown source {name!r} in {item!r}: expected one of {', '.join(SOURCE_NAMES)}")
    if not sep:
        return name, 1.0
    try:
        value = float(weight)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"weight of {name!r} must be a positive number, got {weight!r} (e.g. {name}:2)")
    return name, value
