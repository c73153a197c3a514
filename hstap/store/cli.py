"""`hstap store info|verify DIR`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="inspect or verify a capture store")
    ssub = p.add_subparsers(dest="store_cmd", required=True)
    info = ssub.add_parser("info", help="samples, tokens, layers, dtype, bytes/token, bytes on disk")
    info.add_argument("dir", type=Path)
    info.add_argument("--json", action="store_true")
    verify = ssub.add_parser("verify", help="check every shard's checksum; exit 1 naming a bad shard")
    verify.add_argument("dir", type=Path)


def format_info(info: dict) -> str:
    return "\n".join(f"  {key:>17}: {value}" for key, value in info.items())


def run(args: argparse.Namespace) -> int:
    from hstap.store import store_info, verify_store

    if args.store_cmd == "info":
        info = store_info(args.dir)
        print(json.dumps(info, indent=2, default=str) if args.json else format_info(info))
        return 0
    problems = verify_store(args.dir)
    for line in problems:
        print(f"BAD {line}")
    if problems:
        return 1
    print(f"ok: every shard of {args.dir} verifies")
    return 0
