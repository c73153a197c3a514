"""`hstap eval`: flags → EvalConfig → run_eval.

    hstap eval --drafter runs/drafter --bench mt-bench --limit 20 --chain 3
    hstap eval --drafter runs/drafter --bench jsonl:prompts.jsonl --tree 8,8,60 --chain 3 --json
"""

from __future__ import annotations

import json

from hstap.config import add_config_flags
from hstap.evaluate.config import EvalConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, EvalConfig, "eval")


def run(cfg: EvalConfig) -> int:
    from hstap.evaluate.run import run_eval

    result = run_eval(cfg, progress=not cfg.as_json)
    print(json.dumps(result.to_dict(), indent=2) if cfg.as_json else result.summary())
    return 0
