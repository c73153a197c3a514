"""Records shared by every source: a `Conversation` and the `SkipReport` that accounts for what was dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
# counted outcomes of items that still went through (changed on the way), not drops
KEPT_REASONS = frozenset({"truncated", "recovered_continuation", "continue_cue_dropped", "loop_cut",
                          "loop_tokens_cut"})


@dataclass
class Conversation:
    """One chat: `messages` are `{"role": "system"|"user"|"assistant", "content": str}` dicts.

    `source` names where it came from (`sharegpt`, `mt-bench`, a jsonl path); `meta` keeps source-specific
    extras such as the MT-bench category, so later stages can group results without re-reading the source.
    """

    id: str
    messages: list[dict[str, str]]
    source: str
    meta: dict[str, object] = field(default_factory=dict)


@dataclass
class SkipReport:
    """Counts of dropped, skipped or truncated items by reason, plus free-text notes (e.g. a dropped file tail).

    Every source and the renderer count here whatever they do not pass through unchanged, so nothing is lost
    silently. Reasons name their unit: record-level skips (`empty_turn`, `bad_role`, ...) and sample-level
    outcomes (`truncated`, `too_long`, ...) may share one report.
    """

    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    first: str = ""  # the first dropped item, `where: reason` (e.g. `prompts.jsonl:3: empty_turn`), to go and look

    def add(self, reason: str, n: int = 1, where: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        if not self.first and reason not in KEPT_REASONS:
            self.first = f"{where}: {reason}" if where else reason

    def skipped_line(self, unit: str = "records") -> str:
        """`skipped 2 records (empty_turn=1, too_long=1; first: F:3: empty_turn)`: the line a command that reads
        records prints whenever it dropped any, so no drop goes unsaid; '' when none was dropped."""
        if not self.total:
            return ""
        dropped = sorted(((k, v) for k, v in self.counts.items() if k not in KEPT_REASONS),
                         key=lambda kv: (-kv[1], kv[0]))
        return f"skipped {self.total} {unit} ({', '.join(f'{k}={v}' for k, v in dropped)}; first: {self.first})"

    @property
    def total(self) -> int:
        """Items dropped; outcomes in KEPT_REASONS (e.g. `truncated`) are counted apart, they were kept."""
        return sum(v for k, v in self.counts.items() if k not in KEPT_REASONS)

    def summary(self) -> str:
        """One line, e.g. `skipped 3 (empty_turn=2, bad_role=1); truncated 4`, most frequent reason first."""
        dropped = {k: v for k, v in self.counts.items() if k not in KEPT_REASONS}
        if not dropped:
            line = "skipped 0"
        else:
            parts = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
            line = f"skipped {self.total} ({parts})"
        kept = [f"{k} {v}" for k, v in sorted(self.counts.items()) if k in KEPT_REASONS]
        return "; ".join([line, *kept, *self.notes])
