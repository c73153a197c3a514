"""Programming requests built from standard-library units: explain, complete, fix a planted bug, test, annotate,
rewrite. Deterministic: the same units and seed give the same requests in the same order.

    from hstap.data.code import stdlib_units
    from hstap.data.code_tasks import code_requests
    for conv in code_requests(stdlib_units(), seed=0, tasks_per_unit=2, report=report): ...

Each unit gets up to `tasks_per_unit` distinct tasks, drawn by a generator seeded with the seed and the unit's
key. Requests come in passes, so a small quota spans as many units as possible:

    units shuffled by seed: [u7, u2, u9]  ->  (u7, t1) (u2, t1) (u9, t1) (u7, t2) (u2, t2) (u9, t2)

Units that repeat an earlier one closely (word-shingle MinHash over the code) are counted `near_duplicate_code`
and get no request. A conversation's meta holds the task (`category`), the unit, and for `fix_bug` the planted
change (`bug`, e.g. "line 6: `is` became `is not`"): the answer key, never shown to the model.
"""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Iterator

from hstap.data.code import CodeUnit
from hstap.data.config import NEAR_DUP
from hstap.data.dedupe import Deduper
from hstap.data.mutate import Site, apply, choose_mutation
from hstap.data.types import Conversation, SkipReport

SOURCE = "code"
TASKS = ("explain", "complete", "fix_bug", "write_tests", "annotate", "rewrite")

# {what}: "the function `name`" / "the method `Class.name`" / "the class `Name`"; {module}: "json.decoder"
TEMPLATES: dict[str, tuple[str, ...]] = {
    "explain": (
        "Explain what {what} from Python's `{module}` module does, step by step.",
        "I found this code in the `{module}` module of the Python standard library. What does {what} do, and "
        "when would I use it?",
        "Walk me through {what} (from `{module}`): its inputs, what it computes and what it returns or changes.",
    ),
    "complete": (
        "Here is the beginning of {what} from Python's `{module}` module. The rest of its body is missing: "
        "finish it so that it does what its name, signature and the code so far suggest.",
        "Complete {what}. Only the first part of the body is written; write the remaining code.",
    ),
    "fix_bug": (
        "{What} below, adapted from Python's `{module}` module, has a bug: one small change makes it behave "
        "wrongly. Find the bug, explain what goes wrong, and give the corrected code.",
        "Something is off in {what}. Can you spot the bug and fix it?",
        "This code from `{module}` does not work as intended. Where is the mistake in {what}, and what is the fix?",
    ),
    "write_tests": (
        "Write unit tests with pytest for {what} from Python's `{module}` module. Cover normal use and edge cases.",
        "How would you test {what}? Write a small pytest test suite for it.",
    ),
    "annotate": (
        "Add type hints and a clear docstring to {what} (from `{module}`), without changing its behaviour.",
        "Please add type annotations to {what} and document its parameters and return value.",
    ),
    "rewrite": (
        "Rewrite {what} from Python's `{module}` module in a more idiomatic, readable modern Python style, "
        "keeping its behaviour the same. Explain the main changes.",
        "Can you refactor {what} to make it cleaner and easier to read? It must still do exactly the same thing.",
    ),
}


def code_requests(units: list[CodeUnit], seed: int, tasks_per_unit: int = len(TASKS), near_dup: float = NEAR_DUP,
                  report: SkipReport | None = None) -> Iterator[Conversation]:
    """One-turn conversations asking for work on `units`, in passes (module docstring); lazy, so a quota reads
    only as many units as it needs. Every unit left out is counted in `report`."""
    order = list(units)
    random.Random(seed).shuffle(order)
    plans: list[tuple[CodeUnit, list[str]]] = []
    dedupe = Deduper(threshold=near_dup, shingle=3, seed=seed)
    for unit in order:  # pass 1: every unit's first task; the later passes reuse the plans made here
        if dedupe.admit(unit.code) is not None:
            if report is not None:
                report.add("near_duplicate_code")
            continue
        tasks = _tasks_for(unit, seed)[:tasks_per_unit]
        plans.append((unit, tasks))
        yield request(unit, tasks[0], seed)
    for k in range(1, tasks_per_unit):
        for unit, tasks in plans:
            if k < len(tasks):
                yield request(unit, tasks[k], seed)


def eligible_tasks(unit: CodeUnit, seed: int) -> list[str]:
    """`complete` needs a function body of two statements or more; `fix_bug` needs something to flip."""
    tasks = ["explain", "write_tests", "annotate", "rewrite"]
    if _cut_line(unit) is not None:
        tasks.append("complete")
    if (unit.kind != "class" or len(unit.code) < 1500) and planted_bug(unit, seed) is not None:
        tasks.append("fix_bug")  # (a long class would make the planted bug a needle in a haystack)
    return [t for t in TASKS if t in tasks]


def request(unit: CodeUnit, task: str, seed: int) -> Conversation:
    """The conversation asking for `task` on `unit`: prose, then the code in a fenced block."""
    rng = random.Random(f"{seed}/{unit.key}/{task}")
    meta: dict[str, object] = {"category": task, "unit": unit.key, "kind": unit.kind}
    code = unit.code
    if task == "complete":
        code = "\n".join(code.splitlines()[:_cut_line(unit)]) + "\n"
    elif task == "fix_bug":
        site = planted_bug(unit, seed)
        assert site is not None, f"fix_bug planned for {unit.key} without a bug to plant"
        code, meta["bug"], meta["bug_kind"] = apply(code, site), site.description, site.kind
    what = {"function": f"the function `{unit.name}`", "method": f"the method `{unit.qualname}`",
            "class": f"the class `{unit.name}`"}[unit.kind]
    text = rng.choice(TEMPLATES[task]).format(what=what, What=what[0].upper() + what[1:], module=unit.module)
    return Conversation(id=f"{SOURCE}-{unit.key}-{task}", source=SOURCE, meta=meta,
                        messages=[{"role": "user", "content": f"{text}\n\n```python\n{code.rstrip()}\n```"}])


@functools.lru_cache(maxsize=1 << 14)
def planted_bug(unit: CodeUnit, seed: int) -> Site | None:
    """The one change `fix_bug` plants in `unit` for `seed` (cached: planning and the request both ask)."""
    return choose_mutation(unit.code, random.Random(f"{seed}/{unit.key}/fix_bug"))


def _tasks_for(unit: CodeUnit, seed: int) -> list[str]:
    tasks = eligible_tasks(unit, seed)
    random.Random(f"{seed}/{unit.key}").shuffle(tasks)
    return tasks


def _cut_line(unit: CodeUnit) -> int | None:
    """Lines of `unit.code` to keep for `complete`: the signature, the docstring and the first half of the other
    statements (at least one statement is left to write). None when the unit is not such a function."""
    if unit.kind == "class":
        return None
    node = ast.parse(unit.code).body[0]
    body = node.body
    doc = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    statements = body[doc:]
    if len(statements) < 2 or statements[0].lineno == node.lineno:
        return None
    return body[doc + len(statements) // 2 - 1].end_lineno  # >= 1 statement kept, >= 1 left to write
