"""Every `hstap …` command line in README.md, docs/ and the package's docstrings parses with the real parser, so an
example cannot go stale (a renamed flag, a command that no longer exists) without this test failing."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from hstap.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
WORD = re.compile(r"[a-z][a-z-]*")


def _code_lines(markdown: str) -> list[str]:
    """Lines of fenced code blocks (continuations joined) and inline code spans."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            lines.append(line)
        else:
            lines.extend(re.findall(r"`([^`]+)`", line))
    return _join_continuations(lines)


def _docstring_lines(source: str) -> list[str]:
    """Lines of every docstring in a module (module, classes, functions)."""
    nodes = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = [ast.get_docstring(n, clean=False) for n in nodes]
    return _join_continuations([line for doc in docs if doc for line in doc.splitlines()])


def _join_continuations(lines: list[str]) -> list[str]:
    out, pending = [], ""
    for line in lines:
        line = line.replace("\\\\", "\\")  # docstrings escape the backslash
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def commands_in(line: str) -> list[list[str]]:
    """The `hstap` invocations in one line, as argv lists for the parser (usage notation normalised: `[...]`
    optional groups and `...` dropped, `a|b` alternatives → `a`)."""
    line = re.split(r"\s#\s|\s[|>]\s|\s2?>>?\s", line)[0]  # comments, pipes and redirections are the shell's
    found = []
    for piece in re.split(r"&&|\$\(|\)|;|──►|->", line):
        match = re.match(r"\s*(?:\$\s*)?(?:\S*/)?hstap\s+(\S.*)", piece) or re.search(r"-m hstap\.cli\s+(\S.*)", piece)
        if not match:
            continue
        rest = re.sub(r"\[[^\]]*\]", " ", match.group(1)).replace("...", " ").replace("…", " ")
        try:
            words = shlex.split(rest)
        except ValueError:
            words = rest.split()
        if not words or not WORD.fullmatch(words[0]):
            continue  # prose ("hstap eager: 19.8 tok/s"), not an invocation
        found.append([w.split("|")[0] for w in words])
    return found


def _all_examples() -> list[tuple[str, list[str]]]:
    examples = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in _code_lines(path.read_text()):
            examples += [(f"{path.relative_to(ROOT)}: {line.strip()}", argv) for argv in commands_in(line)]
    for path in sorted([*(ROOT / "hstap").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        for line in _docstring_lines(path.read_text()):
            examples += [(f"{path.relative_to(ROOT)}: {line.strip()}", argv) for argv in commands_in(line)]
    return examples


EXAMPLES = _all_examples()


def test_examples_are_found():
    assert len(EXAMPLES) > 40, "the extraction broke: too few hstap command lines found"
    assert {argv[0] for _, argv in EXAMPLES} >= set(COMMANDS), "every command has a documented example"


@pytest.mark.parametrize("where,argv", EXAMPLES, ids=[w[:90] for w, _ in EXAMPLES])
def test_example_parses(where: str, argv: list[str]):
    assert argv[0] in COMMANDS, f"{where}: 'hstap {argv[0]}' is not a command (commands: {', '.join(COMMANDS)})"
    if len(argv) == 1:
        return  # a mention of the command in prose (`hstap compare`), not an invocation
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exit_info:
            if exit_info.code:  # `--help` exits 0
                pytest.fail(f"{where}: {err.getvalue().strip().splitlines()[-1]}")


@pytest.mark.parametrize("line,argv", [
    ("hstap eval --drafter D --chain 3  # comment", [["eval", "--drafter", "D", "--chain", "3"]]),
    (".venv/bin/hstap store info runs/cap [--json]", [["store", "info", "runs/cap"]]),
    ("hstap export --format sglang|vllm --out X", [["export", "--format", "sglang", "--out", "X"]]),
    ("torchrun --nproc_per_node 2 -m hstap.cli train --store S", [["train", "--store", "S"]]),
    ("a && hstap compare A B", [["compare", "A", "B"]]),
    ('-d "$(hstap vllm-flags --model M --rpc)"', [["vllm-flags", "--model", "M", "--rpc"]]),
    ("hstap eager:      19.8 tok/s", []),
    ("hstap capture --out runs/cap --plan > run.yaml", [["capture", "--out", "runs/cap", "--plan"]]),
    ("hstap store info runs/cap --json | jq .samples", [["store", "info", "runs/cap", "--json"]]),
])
def test_extraction(line, argv):
    assert commands_in(line) == argv
