"""Read an engine's model sources with `ast` (never importing them: they need a GPU stack) and derive, for one
served architecture, the facts hstap's table (hstap/capture/arch.py) records:

- the classes along an attribute path (`language_model.model` of KimiK25ForConditionalGeneration is a
  DeepseekV2Model), following `self.x = Cls(...)`, factory methods (`self._init_model(...)`), class attributes
  (`model_cls = ...`), constructor parameters and their defaults (`decoder_layer_type=Qwen3DecoderLayer`), the
  keyword arguments a subclass passes to `super().__init__`, and vLLM's `init_vllm_registered_model(...,
  architectures=[...])` through its registry;
- the decoder-layer class (what `self.layers = make_layers(..., lambda ...: Cls(...))` builds);
- whether a class assigns an attribute (`input_layernorm`, `norm`, `embed_tokens`);
- what the layer's `forward` returns, as a contract name (`pairs`, `stream`, `stream_topk`);
- whether the text model calls its layers with `forward_batch` as a positional argument.

This is a small interpreter of name bindings, not of Python: it answers "which classes can this expression
construct", which is what a module name depends on.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PLACEHOLDERS = {"PPMissingLayer"}  # pipeline-parallel stand-ins, never the real module


@dataclass(frozen=True)
class ClassRef:
    module: str  # file stem or dotted path under the package root, e.g. "deepseek_v2"
    name: str


@dataclass
class Frame:
    """A function being read: defined in `owner`, running on an instance of `actual`, its parameters bound to
    expressions of the calling frame."""

    owner: ClassRef
    actual: ClassRef
    func: ast.FunctionDef
    args: dict[str, tuple["Frame | None", ast.expr]] = field(default_factory=dict)


class EngineSource:
    """The model files of one engine: `root` is the directory of its models package (`.../sglang/srt/models`)."""

    def __init__(self, root: Path, package: str, registry: dict[str, tuple[str, str]] | None = None) -> None:
        self.root, self.package, self.registry = root, package, registry or {}

    # ---- files and classes ---------------------------------------------------------------------------------

    def path(self, module: str) -> Path | None:
        """`a.b` -> ROOT/a/b.py, or ROOT/a/b/__init__.py for a package; None outside the engine's files."""
        base = self.root / module.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
        return None

    @lru_cache(maxsize=None)
    def tree(self, module: str) -> ast.Module:
        return ast.parse(self.path(module).read_text())

    def served_class(self, arch: str) -> ClassRef:
        """The class an architecture name loads: vLLM's registry, or the SGLang file defining it."""
        if arch in self.registry:
            module, name = self.registry[arch]
            found = self.lookup(module, name)
            assert found is not None, f"{arch}: {name} not found from {module}"
            return found
        pattern = re.compile(rf"^class {re.escape(arch)}\(", re.M)
        hits = [p for p in sorted(self.root.glob("*.py")) if pattern.search(p.read_text())]
        assert len(hits) == 1, f"{arch}: defined in {hits}"
        return ClassRef(hits[0].stem, arch)

    def classdef(self, ref: ClassRef) -> ast.ClassDef:
        for node in self.tree(ref.module).body:
            if isinstance(node, ast.ClassDef) and node.name == ref.name:
                return node
        raise LookupError(f"{ref}: no such class")

    def lookup(self, module: str, name: str) -> ClassRef | None:
        """A name as seen from a module: a class defined there, or imported from a sibling model file."""
        tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return ClassRef(module, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    target = self._module_of(node.module, node.level, module)
                    if target is not None:
                        return self.lookup(target, alias.name)
        return None

    def _module_of(self, dotted: str, level: int, current: str) -> str | None:
        if level:
            parts = current.split(".")
            if self.path(current).name != "__init__.py":
                parts = parts[:-1]  # a module's level 1 is its package; a package's is itself
            base = parts[:len(parts) - (level - 1)]
            dotted = ".".join([*base, dotted]) if dotted else ".".join(base)
        elif dotted.startswith(self.package + "."):
            dotted = dotted[len(self.package) + 1:]
        else:
            return None
        return dotted if self.path(dotted) is not None else None

    def mro(self, ref: ClassRef) -> list[ClassRef]:
        out, todo = [], [ref]
        while todo:
            cur = todo.pop(0)
            if cur in out:
                continue
            out.append(cur)
            for base in self.classdef(cur).bases:
                name = base.id if isinstance(base, ast.Name) else None
                found = self.lookup(cur.module, name) if name else None
                if found is not None:
                    todo.append(found)
        return out

    def method(self, ref: ClassRef, name: str) -> tuple[ClassRef, ast.FunctionDef] | None:
        for cls in self.mro(ref):
            for node in self.classdef(cls).body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return cls, node
        return None

    def class_attr(self, ref: ClassRef, name: str) -> tuple[ClassRef, ast.expr] | None:
        for cls in self.mro(ref):
            for node in self.classdef(cls).body:
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in node.targets):
                    return cls, node.value
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                        node.target.id == name and node.value is not None:
                    return cls, node.value
        return None

    # ---- what an expression can construct ------------------------------------------------------------------

    def values(self, frame: Frame, expr: ast.expr, seen: frozenset = frozenset()) -> set[ClassRef]:
        """Classes `expr` can evaluate to (as a class object, not an instance)."""
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.values(frame, v, seen) for v in expr.values))
        if isinstance(expr, ast.IfExp):
            return self.values(frame, expr.body, seen) | self.values(frame, expr.orelse, seen)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            found = self.class_attr(frame.actual, expr.attr)
            return self.values(Frame(found[0], frame.actual, frame.func), found[1], seen) if found else set()
        if not isinstance(expr, ast.Name):
            return set()
        name = expr.id
        if name in frame.args and (name, id(frame)) not in seen:
            caller, bound = frame.args[name]
            return self.values(caller or frame, bound, seen | {(name, id(frame))})
        local = self._local_assignments(frame.func, name)
        if local and (name, "local", id(frame)) not in seen:
            inner = seen | {(name, "local", id(frame))}
            return set().union(*(self.values(frame, v, inner) for v in local)) | self._param_default(frame, name, inner)
        default = self._param_default(frame, name, seen)
        if default or name in self._params(frame.func):
            return default
        found = self.lookup(frame.owner.module, name)
        return {found} if found else set()

    def _params(self, func: ast.FunctionDef) -> list[str]:
        a = func.args
        return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]

    def _param_default(self, frame: Frame, name: str, seen: frozenset) -> set[ClassRef]:
        a = frame.func.args
        positional = [*a.posonlyargs, *a.args]
        pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
        pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for param, default in pairs:
            if param.arg == name and (name, id(frame)) not in seen:
                return self.values(frame, default, seen | {(name, id(frame))})
        return set()

    @staticmethod
    def _local_assignments(func: ast.FunctionDef, name: str) -> list[ast.expr]:
        return [n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]

    def constructed(self, frame: Frame, expr: ast.expr) -> list[tuple[ClassRef, Frame, ast.Call]]:
        """(class, calling frame, call) for every construction inside `expr` (lambdas and factory calls too)."""
        out = []
        for call in [n for n in ast.walk(expr) if isinstance(n, ast.Call)]:
            func = call.func
            if isinstance(func, ast.Name) and func.id == "init_vllm_registered_model":
                out += [(self.served_class(a), frame, call) for a in self._archs_kwarg(call)]
                continue
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                found = self.method(frame.actual, func.attr)
                if found is not None:
                    sub = Frame(found[0], frame.actual, found[1], self._bind(found[1], call, frame))
                    for ret in [n for n in ast.walk(found[1]) if isinstance(n, ast.Return) and n.value]:
                        out += self.constructed(sub, ret.value)
                    continue
            out += [(cls, frame, call) for cls in self.values(frame, func)]
        return out

    def _bind(self, func: ast.FunctionDef, call: ast.Call, caller: Frame) -> dict:
        params = [p.arg for p in [*func.args.posonlyargs, *func.args.args]][1:]  # drop self
        bound = {p: (caller, a) for p, a in zip(params, call.args)}
        bound.update({k.arg: (caller, k.value) for k in call.keywords if k.arg})
        return bound

    @staticmethod
    def _archs_kwarg(call: ast.Call) -> list[str]:
        for kw in call.keywords:
            if kw.arg == "architectures" and isinstance(kw.value, (ast.List, ast.Tuple)):
                return [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
        raise AssertionError("init_vllm_registered_model without architectures=[...]: the class depends on "
                             "the checkpoint's text_config")

    # ---- attributes of an instance -------------------------------------------------------------------------

    def init_frames(self, ref: ClassRef, ctor: dict) -> list[Frame]:
        """`__init__` frames along the MRO, each bound to what the class below passed to `super().__init__`."""
        frames, args = [], ctor
        for cls in self.mro(ref):
            init = next((n for n in self.classdef(cls).body if isinstance(n, ast.FunctionDef)
                         and n.name == "__init__"), None)
            if init is None:
                continue
            frame = Frame(cls, ref, init, args)
            frames.append(frame)
            sup = next((n for n in ast.walk(init) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr == "__init__" and isinstance(n.func.value, ast.Call)), None)
            args = {}
            parents = self.mro(ref)[self.mro(ref).index(cls) + 1:]
            if sup is not None and parents:  # the parent's parameters, by position and keyword
                parent_init = self.method(parents[0], "__init__")
                args = self._bind(parent_init[1], sup, frame) if parent_init else {}
        return frames

    def assigned(self, ref: ClassRef, attr: str, ctor: dict | None = None) -> list[tuple[Frame, ast.expr]]:
        """Values assigned to `self.<attr>` by the first `__init__` along the MRO that assigns it."""
        for frame in self.init_frames(ref, ctor or {}):
            found = []
            for node in ast.walk(frame.func):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    elts = target.elts if isinstance(target, ast.Tuple) else [target]
                    if any(isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
                           and e.attr == attr for e in elts):
                        found.append((frame, node.value))
            if found:
                return found
        return []

    def child(self, ref: ClassRef, attr: str, ctor: dict | None = None) -> tuple[ClassRef, dict]:
        """The one class `self.<attr>` is built from (placeholders aside) and the arguments it gets."""
        built = {}
        for frame, value in self.assigned(ref, attr, ctor):
            for cls, caller, call in self.constructed(frame, value):
                if cls.name not in PLACEHOLDERS and cls not in built:
                    built[cls] = self._ctor_args(cls, call, caller)
        assert len(built) == 1, f"{ref.name}.{attr}: built from {sorted(c.name for c in built)}"
        return next(iter(built.items()))

    def _ctor_args(self, cls: ClassRef, call: ast.Call, caller: Frame) -> dict:
        init = self.method(cls, "__init__")
        return self._bind(init[1], call, caller) if init else {}

    # ---- behaviour -----------------------------------------------------------------------------------------

    def output_contract(self, layer: ClassRef) -> str:
        """What the layer's forward returns: `pairs` (hidden, residual), `stream_topk` (hidden, topk_indices) or
        `stream` (one tensor; the residual lives elsewhere)."""
        owner, forward = self.method(layer, "forward")
        kinds = {self._return_kind(forward, ret.value) for ret in ast.walk(forward)
                 if isinstance(ret, ast.Return) and ret.value is not None}
        assert len(kinds) == 1, f"{layer.name}.forward returns {kinds}"
        return kinds.pop()

    def _return_kind(self, func: ast.FunctionDef, value: ast.expr) -> str:
        if isinstance(value, ast.Name):
            local = self._local_assignments(func, value.id)
            if len(local) == 1 and isinstance(local[0], ast.Tuple):
                value = local[0]
        if isinstance(value, ast.Tuple) and len(value.elts) == 2 and isinstance(value.elts[1], ast.Name):
            return {"residual": "pairs", "topk_indices": "stream_topk"}.get(value.elts[1].id, "unknown")
        elts = value.elts if isinstance(value, ast.Tuple) else []
        names = [e.id if isinstance(e, ast.Name) else "" for e in elts]
        if names[1:] == ["residual", "topk_indices"]:  # SGLang 0.5.20's DeepSeek layer: a pair, the indices beside
            return "pairs"
        return "stream"

    def batch_positional(self, text: ClassRef) -> bool:
        """Whether the text model's forward passes `forward_batch` positionally to its decoder layers."""
        owner, forward = self.method(text, "forward")
        names = {"layer"}
        calls = [n for n in ast.walk(forward) if isinstance(n, ast.Call) and (
            (isinstance(n.func, ast.Name) and n.func.id in names)
            or (isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Attribute)
                and n.func.value.attr == "layers"))]
        assert calls, f"{text.name}.forward: no call to a decoder layer found"
        return all(any(isinstance(a, ast.Name) and a.id == "forward_batch" for a in c.args) for c in calls)


MODELS = "model_executor.models"  # vLLM's model package, relative to the vllm package


def vllm_source(vllm_root: Path) -> EngineSource:
    """vLLM's sources (`vllm_root` = the `vllm` package directory), its registry read from `registry.py`: short
    module names live in `vllm.model_executor.models`; a `vllm.models.<pkg>` entry is a package whose `__init__`
    picks an implementation per platform, and the first import of the class there (the CUDA branch) is taken."""
    source = EngineSource(vllm_root, "vllm")
    tree = ast.parse((vllm_root / MODELS.replace(".", "/") / "registry.py").read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                module, cls = value.elts[0].value, value.elts[1].value
                module = module[len("vllm."):] if module.startswith("vllm.") else f"{MODELS}.{module}"
                source.registry.setdefault(key.value, (module, cls))
    return source
