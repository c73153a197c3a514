"""One entry point for every conversation source, selected by a spec string.

    from hstap.data import open_source
    for conv in open_source("jsonl:prompts.jsonl", limit=100): ...
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hstap.config import Loops
from hstap.data.jsonl import iter_jsonl
from hstap.data.mtbench import load_mtbench
from hstap.data.render import RenderedSample, render
from hstap.data.sharegpt import iter_sharegpt
from hstap.data.types import Conversation, SkipReport
from hstap.errors import HstapError

SPECS = ("sharegpt", "mt-bench", "jsonl:PATH", "sharegpt-all")


def open_source(spec: str, limit: int | None = None, report: SkipReport | None = None) -> Iterator[Conversation]:
    """Conversations from `spec` (one of SPECS); `limit` caps the number of valid records yielded.

    `sharegpt-all` is ShareGPT with its continuation chunks recovered (hstap/data/sharegpt.py)."""
    if spec in ("sharegpt", "sharegpt-all"):
        convs = iter_sharegpt(report=report, continuations=spec == "sharegpt-all")
    elif spec == "mt-bench":
        convs = iter(load_mtbench())
    elif spec.startswith("jsonl:") and spec[len("jsonl:"):]:
        convs = iter_jsonl(spec[len("jsonl:"):], report=report)
    else:
        raise HstapError(f"unknown data source {spec!r}: expected one of {', '.join(SPECS)}")
    if limit is not None and limit < 0:
        raise HstapError(f"limit must be >= 0 or None, got {limit}")
    return itertools.islice(convs, limit)


def render_all(spec: str, tokenizer, report: SkipReport, max_tokens: int, overlong: str = "truncate",
               limit: int | None = None, loops: Loops = "keep") -> list[RenderedSample]:
    """Every usable conversation of `spec`, rendered up front (exact token counts for a disk estimate, data errors
    before any model loads). `limit` counts usable samples, after rendering; every skip goes into `report`."""
    samples = []
    for conv in open_source(spec, report=report):
        if limit is not None and len(samples) >= limit:
            break
        sample = render(conv, tokenizer, max_tokens=max_tokens, overlong=overlong, report=report, loops=loops)
        if sample is not None:
            samples.append(sample)
    return samples
