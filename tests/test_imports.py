"""The package's import graph has no cycle (module or package level), and the CLI starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hstap"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module → the hstap modules it imports, anywhere in its body (function-level imports included: a cycle
    hidden inside a function is still a cycle)."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Stage package → stage packages it imports (`hstap.capture.tap` belongs to `hstap.capture`)."""
    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for source, targets in graph.items():
        out.setdefault(package(source), set()).update(package(t) for t in targets if package(t) != package(source))
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_stage_packages_form_a_dag():
    assert cycles(package_graph(import_graph())) == []


def test_core_never_imports_an_engine():
    """Engine adapters import SGLang/vLLM inside functions only; nothing imports them at module level."""
    for name, path in module_names().items():
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        roots = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not roots & {"sglang", "vllm"}, f"{name} imports an engine at module level"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["capture", "--help"], ["serve", "--help"],
                                  ["prompts", "--out", "p.jsonl", "--total", "9", "--plan"]])
def test_cli_help_imports_no_torch(argv):
    code = ("import sys, contextlib, io\nfrom hstap.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try: main({argv!r})\n    except SystemExit: pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules)\n"
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"hstap {' '.join(argv)} imported {done.stdout.strip()}"
