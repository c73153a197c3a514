"""The provenance file of a prompt set: `prompts.jsonl.provenance.json`, rewritten atomically after every step.

    {"format": 1, "file": "prompts.jsonl", "settings": {seed, model, filters, ...}, "total": 1000,
     "weights": {"sharegpt": 1.0, ...}, "model": {"name", "id", "fingerprint"}, "python": "3.11.7",
     "sources": {"magpie": {"requested": 333, "produced": 333, "examined": 1184, "kept": 333,
                            "dropped": {"unfinished": 201, ...}, "source_skips": {}, "source_changes": {},
                            "categories": {...},
                            "next_attempt": 1184}, ...},
     "runs": [{"started", "seconds", "device", "batch_size", "written": {...}, "partial_bytes_removed"}],
     "notes": [...]}

Counts add up per source: `examined = kept + sum(dropped)`. `kept` counts the candidates the source's pass kept
(already in the file or written now); `produced` counts the source's records in the file (equal to `kept` unless
a later run asked for fewer). For ShareGPT and code, whose order is fixed by the seed, every run replays the pass
from the start, so their counts describe that whole pass; Magpie's counts accumulate over runs, and
`next_attempt` (= its `examined`) is where sampling resumes. `source_skips` are records or code units the source
itself refused before any prompt existed (ShareGPT's `empty_turn`, code's `private`, ...); `source_changes` counts
records it passed on changed (ShareGPT's `recovered_continuation`).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hstap.data.config import PromptsConfig
from hstap.data.types import KEPT_REASONS, SkipReport
from hstap.errors import HstapError

FORMAT = 1


@dataclass
class Tally:
    """What one source did for the file (see the module docstring for how the counts relate)."""

    requested: int = 0
    produced: int = 0
    examined: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    source_skips: dict[str, int] = field(default_factory=dict)
    source_changes: dict[str, int] = field(default_factory=dict)
    categories: dict[str, int] = field(default_factory=dict)
    next_attempt: int | None = None
    notes: list[str] = field(default_factory=list)

    def take_report(self, report: SkipReport) -> None:
        """A source's SkipReport: what it refused, what it changed, and its notes."""
        self.source_skips = {k: v for k, v in sorted(report.counts.items()) if k not in KEPT_REASONS}
        self.source_changes = {k: v for k, v in sorted(report.counts.items()) if k in KEPT_REASONS}
        self.notes = list(report.notes)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def adds_up(self) -> bool:
        return self.examined == self.kept + sum(self.dropped.values())

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Tally":
        try:
            return cls(**data)
        except TypeError as exc:
            raise HstapError(f"{where}: not a source tally ({exc}): delete the provenance file to start its "
                             f"counts over") from None


def read(path: Path) -> dict | None:
    """The provenance of an earlier run, or None when there is none."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise HstapError(f"{path}: not a readable provenance file ({exc}): fix or delete it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("settings"), dict):
        raise HstapError(f"{path}: not an hstap prompts provenance file of format {FORMAT}: delete it or choose "
                         f"another --out")
    return data


def check_same_settings(previous: dict, cfg: PromptsConfig, path: Path) -> None:
    """Refuse to grow a file with prompts made differently: the first setting that changed, named."""
    now = cfg.identity()
    for key, value in now.items():
        if key in previous["settings"] and previous["settings"][key] != value:
            raise HstapError(f"{cfg.out} was built with {key}={previous['settings'][key]!r} ({path.name}); this run "
                             f"has {value!r}: re-run with the same setting to resume, or choose another --out")


def tallies_from(previous: dict | None, path: Path) -> dict[str, Tally]:
    if previous is None:
        return {}
    sources = previous.get("sources", {})
    return {name: Tally.from_json(data, f"{path}: sources.{name}") for name, data in sources.items()}


def document(cfg: PromptsConfig, tallies: dict[str, Tally], runs: list[dict], model: dict | None,
             notes: list[str]) -> dict:
    """The provenance object for the file as it is now."""
    return {"format": FORMAT, "file": cfg.out.name, "settings": cfg.identity(), "total": cfg.total,
            "weights": cfg.weights(), "model": model, "python": platform.python_version(),
            "sources": {name: asdict(t) for name, t in tallies.items()}, "runs": runs, "notes": notes}


def write(path: Path, data: dict) -> None:
    """Write `data` to a temporary file and rename it into place: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
