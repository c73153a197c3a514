"""`hstap` command line: a thin shell that parses flags into a stage's config and calls its entry function.

    hstap capture --model smollm2 --data sharegpt --limit 100 --out runs/cap
    hstap store info runs/cap [--json]
    hstap store verify runs/cap

Each subcommand lives next to its stage as `hstap/<stage>/cli.py` with `add_parser(sub)` and `run(args) -> int`;
COMMANDS below is the one registry. Errors the user can fix print as one line (exit 2); `--debug` shows the
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hstap.errors import HstapError

COMMANDS = {
    "capture": "hstap.capture.cli",
    "train": "hstap.train.cli",
    "eval": "hstap.evaluate.cli",
    "synth": "hstap.synth.cli",
    "store": "hstap.store.cli",
    "demo": "hstap.demo",
    "sglang-flags": "hstap.capture.sglang_cli",
    "vllm-flags": "hstap.capture.vllm_cli",
    "capture-remote": "hstap.capture.remote",
    "serve": "hstap.serve.cli",
    "compare": "hstap.store.compare",
    "export": "hstap.export.cli",
}


def stage_config(config_cls, args: argparse.Namespace, **fields):
    """A stage's pydantic config from the flags named like its fields (plus `fields`); printed when --plan is set,
    so `hstap STAGE ... --plan` shows what would run."""
    flags = {k: v for k, v in vars(args).items() if k in config_cls.model_fields}
    cfg = config_cls(**{**flags, **fields})
    if getattr(args, "plan", False):
        print(cfg.model_dump_json(indent=2))
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hstap", description="hidden-state tap: EAGLE-3 drafters for your LLM")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        return f"config field {field}: {err['msg']} (got {err.get('input')!r})"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.cmd]).run(args)
    except (HstapError, ValidationError) as exc:
        if args.debug:
            raise
        print(f"hstap: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hstap: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
