"""One entry point for every conversation source, selected by a spec string.

    from hstap.data import open_source
    for conv in open_source("jsonl:prompts.jsonl", limit=100): ...
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hstap.data.jsonl import iter_jsonl
from hstap.data.mtbench import load_mtbench
from hstap.data.sharegpt import iter_sharegpt
from hstap.data.types import Conversation, SkipReport
from hstap.errors import HstapError

SPECS = ("sharegpt", "mt-bench", "jsonl:PATH")


def open_source(spec: str, limit: int | None = None, report: SkipReport | None = None) -> Iterator[Conversation]:
    """Conversations from `spec` (one of SPECS); `limit` caps the number of valid records yielded."""
    if spec == "sharegpt":
        convs = iter_sharegpt(report=report)
    elif spec == "mt-bench":
        convs = iter(load_mtbench())
    elif spec.startswith("jsonl:") and spec[len("jsonl:"):]:
        convs = iter_jsonl(spec[len("jsonl:"):], report=report)
    else:
        raise HstapError(f"unknown data source {spec!r}: expected one of {', '.join(SPECS)}")
    if limit is not None and limit < 0:
        raise HstapError(f"limit must be >= 0 or None, got {limit}")
    return itertools.islice(convs, limit)
