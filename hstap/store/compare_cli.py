"""`hstap compare DIR_A DIR_B`: flags → CompareConfig → compare_stores."""

from __future__ import annotations

import json
from dataclasses import asdict

from hstap.config import add_config_flags
from hstap.store.config import CompareConfig


def add_arguments(parser) -> None:
    add_config_flags(parser, CompareConfig, "compare")


def run(cfg: CompareConfig) -> int:
    from hstap.store.compare import compare_stores, format_comparison

    c = compare_stores(cfg.dir_a, cfg.dir_b, rtol=cfg.rtol, min_cos=cfg.min_cos,
                       keep_per_sample=cfg.per_sample or cfg.as_json, reference=cfg.reference,
                       within=cfg.within, any_model=cfg.any_model)
    if cfg.as_json:
        print(json.dumps({**asdict(c), "ok": c.ok, "status": c.status, "verdict": c.verdict()}, indent=2))
    else:
        print(format_comparison(c, per_sample=cfg.per_sample))
    return {"match": 0, "common-match": 3, "mismatch": 1}[c.status]
