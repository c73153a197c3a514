"""Conversation sources (ShareGPT, MT-bench, JSONL, stdlib code requests), prompt rules and dedupe, chat rendering
and assistant-only loss masks.

    from hstap.data import SkipReport, open_source, render
    report = SkipReport()
    samples = [s for c in open_source("sharegpt", limit=1000, report=report)
               if (s := render(c, tokenizer, max_tokens=2048, report=report)) is not None]
    print(report.summary())
"""

from hstap.data.jsonl import iter_jsonl
from hstap.data.mtbench import load_mtbench, mtbench_path
from hstap.data.render import RenderedSample, render, render_prompt
from hstap.data.sharegpt import iter_raw_records, iter_sharegpt, sharegpt_path
from hstap.data.sources import SPECS, open_source, render_all
from hstap.data.types import Conversation, SkipReport

__all__ = [
    "SPECS", "Conversation", "RenderedSample", "SkipReport", "iter_jsonl", "iter_raw_records", "iter_sharegpt",
    "load_mtbench", "mtbench_path", "open_source", "render", "render_all", "render_prompt", "sharegpt_path",
]
