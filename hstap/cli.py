"""`hstap` command line: a thin shell that turns flags into a command's config and calls its entry function.

    hstap prompts --out runs/prompts.jsonl --total 3000 --source sharegpt:1 --source magpie:1 --source code:1
    hstap capture --model smollm2 --data sharegpt --limit 100 --out runs/cap
    hstap train --config run.yaml --set train.lr=3e-4 --out runs/drafter --plan
    hstap store info runs/cap [--json]

COMMANDS below is the one registry: name → (module, one-line help). A command's module has
`add_arguments(parser)`, which declares its flags from the command's pydantic config (hstap/config.py), and
`run(cfg) -> int` (and `config_from_args(args)` where it reads more than its own section of `--config`: the
recipe). `--plan` prints the resolved config (a module's `plan(cfg)` where it has more to show) and
exits. Errors the user can fix print as one line (exit 2); `--debug` shows the traceback. Only the module of the
command that runs is imported — `hstap --help` imports none — so start-up costs no torch and no schema building.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hstap.errors import HstapError

COMMANDS = {
    "prompts": ("hstap.synth.prompts_cli", "build a prompt set from ShareGPT, self-written (Magpie) prompts and "
                                           "stdlib code requests"),
    "synth": ("hstap.synth.cli", "regenerate the assistant turns with the target (embedded or served)"),
    "capture": ("hstap.capture.cli", "prefill conversations through the target and store hidden states"),
    "capture-remote": ("hstap.capture.remote_cli", "prefill conversations through a tapped server (sglang, vllm, "
                                                   "hf)"),
    "sglang-flags": ("hstap.capture.sglang_cli", "print SGLang's --forward-hooks JSON and the other flags capture "
                                                 "needs"),
    "vllm-flags": ("hstap.capture.vllm_cli", "print vLLM's launch flags and the collective_rpc body that starts "
                                             "capture"),
    "store": ("hstap.store.cli", "inspect, verify or merge capture stores"),
    "compare": ("hstap.store.compare_cli", "per-layer, per-sample differences between two stores of the same "
                                           "samples"),
    "train": ("hstap.train.cli", "train an EAGLE-3 drafter (offline from a store, or --online)"),
    "eval": ("hstap.evaluate.cli", "speculative decoding with the embedded target: τ, acceptance, speedup"),
    "export": ("hstap.export.cli", "write a trained drafter as an SGLang or vLLM EAGLE-3 draft checkpoint"),
    "serve": ("hstap.serve.cli", "start an engine (with capture taps), wait until ready, watch for hangs"),
    "recipe": ("hstap.recipe.cli", "the whole job for any target from one YAML file: prompts → synth → train → eval "
                                   "→ export, every stage resumable"),
    "demo": ("hstap.demo", "the recipe on the embedded default: prompts → synth → capture → train → eval → export"),
}


def chosen_command(argv: list[str]) -> str | None:
    """The command named in `argv` (the first word that is not an option), if it is one of COMMANDS."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words and words[0] in COMMANDS else None


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (an unknown flag, a bad choice), pointing at --help instead of
    printing the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in `argv` gets its flags (all of them when `argv` is None)."""
    parser = _Parser(prog="hstap", description="hidden-state tap: EAGLE-3 drafters for your LLM")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    chosen = chosen_command(argv) if argv is not None else None
    parser.commands = {}  # name → its parser: an unknown flag is reported by the command it was given to
    for name, (module, help_text) in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        if argv is None or name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hstap.config import config_from_args, plan_text

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.commands[args.cmd].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        module = importlib.import_module(args.module)
        build = getattr(module, "config_from_args", None)  # a command reading several sections of its file (recipe)
        cfg = build(args) if build else config_from_args(args, sections=list(COMMANDS))
        if args.plan:
            print((module.plan(cfg) if hasattr(module, "plan") else plan_text(cfg, args.config_section)).rstrip("\n"))
            return 0
        return module.run(cfg)
    except HstapError as exc:
        if args.debug:
            raise
        _close_progress_bars()
        print(f"hstap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a bare one (Ctrl-C, `timeout -s INT`) has no message: say what stopped it
        _close_progress_bars()
        print(f"hstap: {str(exc) or 'interrupted (SIGINT)'}", file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them


def _close_progress_bars() -> None:
    """Finish any progress bar still open, so the error is the last line on stderr, not a bar's repaint."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
