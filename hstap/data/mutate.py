"""Small deterministic bugs planted in real code, each with a one-line description (the answer key).

    from hstap.data.mutate import apply, choose_mutation
    site = choose_mutation(code, random.Random("seed/unit"))   # None when there is nothing to flip
    buggy = apply(code, site)                                   # the code with that one change
    site.description, site.kind                                 # "line 4: `<` became `<=`", "comparison"

Kinds, each a one-token change a reader can find: a comparison operator flipped (`<` -> `<=`, `==` -> `!=`,
`in` -> `not in`, `is` -> `is not`, and back), `and` <-> `or`, `+` <-> `-`, an integer literal off by one, `True`
<-> `False`, and a `not` removed. Edits are made in the text (positions from `ast`), so comments and formatting
stay; the mutated code always parses and its AST differs from the original's. Nothing inside an f-string is
touched (Python 3.11 reports unreliable positions there).
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

_FLIP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
         ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
         ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
_BOOL = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
_ARITH = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}


@dataclass(frozen=True)
class Site:
    """Replace code[start:end] (== `old`) by `new`; `line` is 1-based within the code."""

    kind: str  # comparison | boolean | arithmetic | off_by_one | bool_literal | not_removed
    start: int
    end: int
    old: str
    new: str
    line: int

    @property
    def description(self) -> str:
        return f"line {self.line}: `{self.old}` became `{self.new}`" if self.new else \
            f"line {self.line}: `{self.old}` was removed"


def choose_mutation(code: str, rng: random.Random) -> Site | None:
    """One mutation of `code`: a kind first, then a site of that kind, so the many integer literals of a function
    do not crowd out its comparisons. A site whose result would not be a different, parsing program is passed
    over (checked only for the site chosen: parsing every candidate would cost a parse per token)."""
    by_kind: dict[str, list[Site]] = {}
    for site in mutation_sites(code):
        by_kind.setdefault(site.kind, []).append(site)
    tree = ast.parse(code)
    while by_kind:
        kind = rng.choice(sorted(by_kind))
        site = by_kind[kind].pop(rng.randrange(len(by_kind[kind])))
        if not by_kind[kind]:
            del by_kind[kind]
        if changes_program(code, tree, site):
            return site
    return None


def mutation_sites(code: str) -> list[Site]:
    """Every single-token mutation of `code` (which must parse), in source order, not yet checked by parsing the
    result (see `changes_program`)."""
    tree = ast.parse(code)
    starts = _line_starts(code)
    sites: list[Site] = []
    in_fstrings = {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
    for node in ast.walk(tree):
        if id(node) in in_fstrings:
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            sites += _between(code, starts, node.left, node.comparators[0], "comparison", *_FLIP[type(node.ops[0])])
        elif isinstance(node, ast.BoolOp) and type(node.op) in _BOOL:
            sites += _between(code, starts, node.values[0], node.values[1], "boolean", *_BOOL[type(node.op)])
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            sites += _between(code, starts, node.left, node.right, "arithmetic", *_ARITH[type(node.op)])
        elif isinstance(node, ast.Constant):
            sites += _constant(code, starts, node)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            start, end = _span(code, starts, node)[0], _span(code, starts, node.operand)[0]
            if re.fullmatch(r"not\s+", code[start:end]):
                sites.append(Site("not_removed", start, end, "not", "", _line_of(starts, start)))
    return sorted(sites, key=lambda s: s.start)


def apply(code: str, site: Site) -> str:
    """`code` with the one change `site` describes."""
    assert code[site.start:site.end].strip() == site.old or site.new == "", f"stale site {site}"
    return code[:site.start] + code[site.start:site.end].replace(site.old, site.new, 1) + code[site.end:]


def _line_starts(code: str) -> list[int]:
    starts, pos = [0], 0
    for line in code.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _offset(code: str, starts: list[int], lineno: int, col_bytes: int) -> int:
    """ast columns count UTF-8 bytes: turn (line, byte column) into an index into the str."""
    line = code[starts[lineno - 1]:starts[lineno]]
    return starts[lineno - 1] + len(line.encode("utf-8")[:col_bytes].decode("utf-8", errors="ignore"))


def _span(code: str, starts: list[int], node: ast.AST) -> tuple[int, int]:
    return (_offset(code, starts, node.lineno, node.col_offset),
            _offset(code, starts, node.end_lineno, node.end_col_offset))


def _line_of(starts: list[int], index: int) -> int:
    return next(k for k in range(1, len(starts)) if starts[k] > index)


def _between(code: str, starts: list[int], left: ast.AST, right: ast.AST, kind: str, old: str,
             new: str) -> list[Site]:
    """The operator between two operands: the gap holds it plus spaces, brackets or line continuations."""
    gap_start, gap_end = _span(code, starts, left)[1], _span(code, starts, right)[0]
    gap = code[gap_start:gap_end]
    pattern = r"(?<![\w<>=!])" + re.escape(old).replace(r"\ ", r"\s+") + r"(?![\w<>=])"
    found = [m for m in re.finditer(pattern, gap)]
    if len(found) != 1 or re.sub(pattern, "", gap).strip(" \t\n\\()") != "":
        return []
    m = found[0]
    at = gap_start + m.start()
    return [Site(kind, at, gap_start + m.end(), m.group(0), new, _line_of(starts, at))]


def _constant(code: str, starts: list[int], node: ast.Constant) -> list[Site]:
    start, end = _span(code, starts, node)
    text = code[start:end]
    if isinstance(node.value, bool):
        return [Site("bool_literal", start, end, text, "False" if node.value else "True", _line_of(starts, start))]
    if isinstance(node.value, int) and re.fullmatch(r"\d+", text) and int(text) == node.value:
        return [Site("off_by_one", start, end, text, str(node.value + 1), _line_of(starts, start))]
    return []


def changes_program(code: str, tree: ast.Module, site: Site) -> bool:
    """The mutated code parses and is a different program (guards against a gap the regex misread)."""
    try:
        return ast.dump(ast.parse(apply(code, site))) != ast.dump(tree)
    except SyntaxError:
        return False
