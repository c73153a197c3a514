"""`hstap store info|verify DIR`, `hstap store merge --out DIR A B ...`."""

from __future__ import annotations

import json

from hstap.config import add_config_flags
from hstap.store.config import StoreInfoConfig, StoreMergeConfig, StoreVerifyConfig


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="store_cmd", required=True)
    add_config_flags(sub.add_parser("info", help=StoreInfoConfig.__doc__.splitlines()[0]), StoreInfoConfig, "store")
    add_config_flags(sub.add_parser("verify", help=StoreVerifyConfig.__doc__.splitlines()[0]), StoreVerifyConfig,
                     "store")
    add_config_flags(sub.add_parser("merge", help=StoreMergeConfig.__doc__.splitlines()[0]), StoreMergeConfig,
                     "store")


def format_info(info: dict) -> str:
    """The info as aligned `key: value` lines, then one `BAD` line per problem found."""
    lines = []
    for key, value in info.items():
        if key == "problems":
            continue
        if key == "projected":
            value = ", ".join(f"{n:,} samples {size}" for n, size in value.items())
        elif key == "bytes_per_token":
            value = f"{value:.1f} (measured over the shards; {value / info['hidden_size']:.2f}·H)"
        elif key == "tokens_per_sample":
            value = f"{value:.1f}"
        lines.append(f"  {key:>24}: {value}")
    return "\n".join(lines + [f"BAD {p}" for p in info.get("problems", [])])


def run(cfg: StoreInfoConfig | StoreVerifyConfig | StoreMergeConfig) -> int:
    from hstap.store import store_info, verify_store

    if isinstance(cfg, StoreMergeConfig):
        from hstap.store.merge import merge_stores

        r = merge_stores(cfg.out, cfg.stores, copy=cfg.copy_shards)
        print(f"merged {len(cfg.stores)} stores into {r.out}: {r.samples:,} samples, {r.tokens:,} tokens, "
              f"{r.shards} shards ({r.linked} hard-linked, {r.copied} copied, {r.kept} already in place)")
        return 0

    if isinstance(cfg, StoreInfoConfig):
        info = store_info(cfg.dir, project=cfg.project)
        print(json.dumps(info, indent=2, default=str) if cfg.as_json else format_info(info))
        return 1 if info["problems"] else 0
    problems = verify_store(cfg.dir)
    for line in problems:
        print(f"BAD {line}")
    if problems:
        return 1
    print(f"ok: every shard of {cfg.dir} verifies")
    return 0
