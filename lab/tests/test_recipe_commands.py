"""The GPU recipe's next calls rehearsed on the CPU: every command that `lab/h200_recipe.sh mfu` and `pair` (and
`graphs`) would run parses with the parser of the program it calls (hstap's, a bench script's, torchrun's
target's), and every test file they name exists. A device session is 30 minutes, and the machine goes back 30 s
after a call: a renamed flag found there costs a step of it (the eighteenth session's phases have never run).

Each phase runs in bash with `step` recording its command instead of running it (and `bundle`, `wait_assets`
doing nothing), so the command lines are the ones the shell would build, variables expanded."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from hstap.cli import COMMANDS, build_parser
from hstap.config import config_from_args

ROOT = Path(__file__).resolve().parents[2]  # the repository: the recipe runs from there
PHASES = ["phase_mfu_short", "phase_mfu", "phase_pair", "phase_graphs"]  # the next GPU calls' phases (docs/distributed.md, issue 15)


def recorded(phase: str, tmp_path: Path) -> list[list[str]]:
    """The argv of every `step` the phase would run, in order."""
    from hstap.models.target import cache_root

    record = tmp_path / f"{phase}.rec"
    # this interpreter and this model cache for what the phase runs itself (the device's python3 finds hstap on its
    # PYTHONPATH; its cache is the session's)
    script = f"""
        source lab/h200_recipe.sh source
        export HSTAP_CACHE='{cache_root()}'; PY='{sys.executable}'
        HSTAP="$PY -m hstap.cli"; TR="$PY -m torch.distributed.run --standalone"
        step() {{ shift; printf '%s\\0' "$@" >> '{record}'; printf '\\n\\0' >> '{record}'; }}
        bundle() {{ :; }}; wait_assets() {{ :; }}
        {phase}
    """
    env = {**os.environ, "RUN": str(tmp_path / "run"), "PATH": os.environ["PATH"]}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    words = record.read_text().split("\0") if record.exists() else []
    commands, current = [], []
    for word in words:
        if word == "\n":
            commands.append(current)
            current = []
        elif word:
            current.append(word)
    return commands


def program(argv: list[str]) -> tuple[str, list[str]]:
    """(what runs, its arguments): `timeout N`, `env K=V`, the interpreter and torchrun's own flags taken off."""
    while argv and (argv[0] in ("timeout", "env") or "=" in argv[0] or argv[0].isdigit()):
        argv = argv[1:]
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    if argv[:2] == ["-m", "torch.distributed.run"]:
        argv = argv[2:]
        while argv and argv[0].startswith("--"):
            argv = argv[1:] if argv[0] == "--standalone" or "=" in argv[0] else argv[2:]
    if argv[:2] == ["-m", "hstap.cli"]:
        return "hstap", argv[2:]
    if argv[:2] == ["-m", "pytest"]:
        return "pytest", argv[2:]
    return argv[0], argv[1:]


class _Parsed(Exception):
    """Raised by the patched parse_args once a bench script's flags parsed: nothing of the script runs."""


def check_bench(script: str, args: list[str]) -> str | None:
    """None if `script` parses `args`; else its argparse error."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        original(self, *a, **kw)
        raise _Parsed

    err = io.StringIO()
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        argparse.ArgumentParser.parse_args = parse_then_stop
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except _Parsed:
        return None
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exited while parsing"
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = argv
    return "the script ran past its argument parsing without parse_args"


def check_hstap(args: list[str]) -> str | None:
    """None if `hstap ARGS` parses and its config validates (as `--plan` would resolve it)."""
    if not args or args[0] not in COMMANDS:
        return f"'{args[:1]}' is not an hstap command"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = build_parser(args).parse_args(args)
        config_from_args(parsed, sections=list(COMMANDS))
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    except Exception as exc:  # noqa: BLE001 — a config the validators refuse, reported as the test's failure
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, list[list[str]]]:
    tmp = tmp_path_factory.mktemp("recipe")
    return {phase: recorded(phase, tmp) for phase in PHASES}


def test_each_phase_runs_its_steps(commands):
    sizes = {phase: len(cmds) for phase, cmds in commands.items()}
    assert sizes["phase_mfu_short"] == 5 and sizes["phase_mfu"] >= 10 and sizes["phase_pair"] >= 12 and sizes["phase_graphs"] >= 4, sizes


@pytest.mark.parametrize("phase", PHASES)
def test_every_command_of_the_phase_parses(commands, phase):
    failures = []
    for argv in commands[phase]:
        what, args = program(argv)
        if what == "hstap":
            why = check_hstap(args)
        elif what == "pytest":
            missing = [a for a in args if a.startswith("tests/") and not (ROOT / a).exists()]
            why = f"no such test file: {missing}" if missing else None
        elif what.endswith(".py"):
            why = check_bench(what, args)
        else:
            why = None  # a shell tool (cp, tar): nothing of ours to parse
        if why:
            failures.append(f"{' '.join(argv)[:160]}\n    -> {why}")
    assert not failures, "\n".join(failures)
