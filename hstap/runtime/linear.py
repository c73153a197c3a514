"""The runtime's projections (a weight and its bias) and, on a CPU, oneDNN's blocked copy of the weight; each row
count multiplies by whichever product `choose_products` measured fastest for it on this machine.

A decoding forward streams every weight from memory once, so a 4-token verification should cost about what a
1-token step does. On a CPU it did not through PyTorch's default fp32 GEMM (MKL): a chain:3 verification cost
about one and a half decoding steps, and about one and a quarter through oneDNN's copy of each weight, reordered
once into its blocked layout, which streams several rows' products faster (`bench/forward_cost.py --reorder on
off`, `bench/cpu_gemm.py`; the figures are in docs/benchmarks.md).

Which product a row count takes is measured when the runtime starts, not fixed, because neither wins at every row
count on every machine. MKL can be ahead at one row, yet it runs products of one to four rows on one core
(`bench/cpu_gemm.py --threads-busy`: 1 of 2 threads busy), so its one-token step reads the weights with one
core's bandwidth while a 4-row verification reads them with both: one token can cost more than four, and then
vanilla decoding, every speedup's baseline, runs slower than the runtime could and speedups come out above τ.
oneDNN's own 1-row kernel streams the copy more slowly than its 4-row one, so a short product may instead run
padded with zero rows to four, at the 4-row kernel's cost plus the padding's.
`choose_products` times each of the model's projections each way (PATHS) at 1, 2, 3 and 4 rows, once per process,
weight shapes and thread count, and every weight shape takes its fastest at each row count (more rows: the 4-row
choice): a one-token forward then costs no more than a four-token one. One rule for the one-token step and for
verification, whose paths include the 4-row product itself, so the step costs at most about what a 4-token
forward does.

The copy costs the weights' bytes once more (538 MB for SmolLM2 in fp32). It is made for fp32 CPU weights when
PyTorch was built with oneDNN (`reorder=None`, the default; `HSTAP_CPU_REORDER=0` turns the default off, for
memory or an A/B) and checked against `F.linear` once per process: a build whose ops are missing or disagree is
said once and every product stays on `F.linear`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hstap.errors import HstapError

REORDERED_FROM_ROWS = 4  # oneDNN's copy is laid out for this many rows (and padded products run at it)
MEASURED_ROWS = (1, 2, 3, 4)  # row counts `choose_products` times; a product of more rows takes the last one's choice
# a product's ways: F.linear (MKL), oneDNN's copy at the input's rows, or at REORDERED_FROM_ROWS rows (zero-padded)
PATHS = ("mkl", "onednn", "padded")
BEFORE_MEASURING = tuple("onednn" if m >= REORDERED_FROM_ROWS else "mkl" for m in MEASURED_ROWS)  # the 12-05 rule


def _reordered(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` (N, K), laid out for products of four rows; any row count multiplies by
    it. Laid out for one row instead, every row count ran slower, one row included (`bench/cpu_gemm.py
    --reorder-hint 1`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, REORDERED_FROM_ROWS)


@functools.cache
def _zeros(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, width) zeros, made once and only ever read (padded products concatenate them below their input)."""
    return torch.zeros(rows, width, dtype=dtype)


def _zero_rows(rows: int, like: torch.Tensor) -> torch.Tensor:
    return _zeros(rows, like.shape[-1], like.dtype)


def _onednn_linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) · Wᵀ + b through oneDNN, W given as `_reordered(W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


@functools.cache
def reorder_works() -> str | None:
    """None when oneDNN's reordered products work in this process (checked once on a small product), else why
    not (said once on stderr)."""
    reason = None
    if not torch.backends.mkldnn.is_available():
        reason = "PyTorch was built without oneDNN"
    else:
        try:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(40, 24, generator=generator)
            bias = torch.randn(40, generator=generator)
            x = torch.randn(2, 5, 24, generator=generator)
            got = _onednn_linear(x, _reordered(weight), bias)
            if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5):
                reason = "its products differ from F.linear's"
        except (RuntimeError, AttributeError) as err:  # an op this build lacks or refuses
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if reason is not None:
        print(f"hstap: CPU products stay on F.linear: oneDNN's reordered weights are unusable ({reason})",
              file=sys.stderr)
    return reason


def wants_reorder(weight: torch.Tensor, reorder: bool | None) -> bool:
    """Whether `weight` gets a reordered copy: `reorder` True/False forces it (True still needs a CPU fp32 weight
    and a working oneDNN), None means yes for fp32 weights on a CPU unless `HSTAP_CPU_REORDER` is 0."""
    if reorder is None:
        switch = os.environ.get("HSTAP_CPU_REORDER", "1")
        if switch not in ("0", "1"):
            raise HstapError(f"HSTAP_CPU_REORDER must be 0 or 1, got {switch!r}")
        reorder = None if switch == "1" else False
    if reorder is False or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return reorder_works() is None


class Projection:
    """x ↦ x·Wᵀ + b. `reordered`: oneDNN's copy of W; `paths[i]`: the product (PATHS) a product of
    MEASURED_ROWS[i] rows takes (the last entry: that many or more), as `choose_products` measured it
    (BEFORE_MEASURING until then; without a copy every product is F.linear)."""

    __slots__ = ("bias", "paths", "reordered", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, reorder: bool | None = None):
        self.weight, self.bias = weight, bias
        self.reordered = _reordered(weight) if wants_reorder(weight, reorder) else None
        self.paths = BEFORE_MEASURING

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) → (..., N), along the path measured fastest for its row count."""
        return self.through(self.paths[min(x.numel() // x.shape[-1], len(self.paths)) - 1], x)

    def through(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """(..., K) → (..., N) along `path` (PATHS; F.linear where there is no copy)."""
        if self.reordered is None or path == "mkl":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        if path == "padded" and rows < REORDERED_FROM_ROWS:  # the 4-row kernel on zero rows too, dropped after
            # one op: a fresh (4, K) tensor per call (F.pad's allocate, fill and copy cost ~2x more per projection)
            block = torch.cat([x.reshape(rows, -1), _zero_rows(REORDERED_FROM_ROWS - rows, x)])  # (4, K)
            return _onednn_linear(block, self.reordered, self.bias)[:rows].view(*x.shape[:-1], -1)  # (..., N)
        return _onednn_linear(x, self.reordered, self.bias)

    @property
    def extra_bytes(self) -> int:
        """Bytes the reordered copy holds (0 without one)."""
        return 0 if self.reordered is None else self.reordered.numel() * self.reordered.element_size()


Shape = tuple[int, int]  # a weight's (N, K)


@dataclass(frozen=True)
class ProductChoice:
    """What `choose_products` measured, per weight shape: ms of its projections' products per path (PATHS) and row
    count (MEASURED_ROWS), each projection's smallest of the rounds, summed (None: not a path at that row count:
    "padded" from four rows on is "onednn"). Every shape takes its fastest path at each row count: padding pays
    for the large weights, whose 1-row kernel streams slowly, and costs more than it saves on the small ones."""

    threads: int
    ms: dict[Shape, dict[str, tuple[float | None, ...]]]
    count: dict[Shape, int]  # projections of each shape

    def paths_for(self, shape: Shape) -> tuple[str, ...]:
        """The path per row count of a weight of `shape` (one that was measured)."""
        table = self.ms[shape]
        return tuple(min((p for p in PATHS if table[p][i] is not None), key=lambda p: table[p][i])
                     for i in range(len(MEASURED_ROWS)))

    def describe(self) -> str:
        """One line for a report: per row count, a pass's ms along the paths taken, how many projections take
        each, and the ms had every projection taken one path."""
        parts = []
        for i, m in enumerate(MEASURED_ROWS):
            taken = {p: sum(n for shape, n in self.count.items() if self.paths_for(shape)[i] == p) for p in PATHS}
            chosen = sum(self.ms[shape][self.paths_for(shape)[i]][i] for shape in self.ms)
            every = [f"{p} {sum(t[p][i] for t in self.ms.values()):.1f}" for p in PATHS
                     if all(t[p][i] is not None for t in self.ms.values())]
            parts.append(f"{m}{'+' if m == MEASURED_ROWS[-1] else ''} row{'s' if m > 1 else ''} {chosen:.1f} ms ("
                         + ", ".join(f"{p} ×{n}" for p, n in taken.items() if n) + "; all through "
                         + ", ".join(every) + ")")
        return f"CPU fp32 products measured at {self.threads} threads, a pass over the projections: " + \
            "; ".join(parts)


_CHOICES: dict[tuple, ProductChoice] = {}  # (weight shapes, thread count) → what was measured


@torch.inference_mode()
def choose_products(projections: list[Projection], rounds: int = 2) -> ProductChoice | None:
    """Time each of `projections` with random inputs of each of MEASURED_ROWS rows along every path (PATHS; each
    projection's smallest of `rounds`, the paths in turn first: another process's load only adds time), and set
    every projection's `paths` to the fastest for its weight's shape per row count. Measured once per process,
    weight shapes and thread count (each path at each row count is a few passes over the model's weights: paid
    once at start, not per call); None when no projection has a copy."""
    copied = [p for p in projections if p.reordered is not None]
    if not copied:
        return None
    key = (tuple(tuple(p.weight.shape) for p in copied), torch.get_num_threads())
    if key not in _CHOICES:
        _CHOICES[key] = _remembered(key, lambda: _measure(copied, rounds))
    choice = _CHOICES[key]
    for p in copied:
        p.paths = choice.paths_for(tuple(p.weight.shape))
    return choice


def _remembered(key: tuple, measure) -> ProductChoice:
    """`measure()`'s choice, kept on disk for this machine until it reboots: every process that builds a runtime
    (each `hstap eval`, synth, serve) would otherwise spend ~1-2 s measuring the same thing. The file is named by the
    weight shapes, thread count, torch version, CPU model and boot id (the relation between the paths changed on
    one VM from one day to the next); an unreadable file is measured again."""
    import hashlib
    import json

    from hstap.models.target import cache_root

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""

    cpu = next((line for line in read("/proc/cpuinfo").splitlines() if line.startswith("model name")), "")
    name = hashlib.sha256(repr((key, torch.__version__, cpu, read("/proc/sys/kernel/random/boot_id"))).encode())
    file = cache_root() / "products" / f"{name.hexdigest()[:16]}.json"
    try:
        raw = json.loads(file.read_text())
        return ProductChoice(raw["threads"], {_shape(s): {p: tuple(t) for p, t in d.items()} for s, d in
                                              raw["ms"].items()}, {_shape(s): n for s, n in raw["count"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    choice = measure()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"threads": choice.threads, "ms": {f"{n}x{k}": d for (n, k), d in choice.ms.items()},
                                   "count": {f"{n}x{k}": c for (n, k), c in choice.count.items()}}))
        tmp.replace(file)  # whole or absent for a process reading it at the same time
    except OSError:
        pass  # a read-only cache: measured again next time
    return choice


def _shape(text: str) -> Shape:
    n, k = text.split("x")
    return int(n), int(k)


def _measure(copied: list[Projection], rounds: int) -> ProductChoice:
    """Each projection's smallest time over the rounds per path and row count, summed per weight shape (a burst of
    another process's load spoils one projection's time in one round, not the pass)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [tuple(p.weight.shape) for p in copied]
    ms: dict[Shape, dict[str, list[float | None]]] = {
        shape: {path: [None] * len(MEASURED_ROWS) for path in PATHS} for shape in shapes}
    for i, m in enumerate(MEASURED_ROWS):
        xs = [torch.randn(m, p.weight.shape[1], generator=generator) for p in copied]  # (m, K) each
        paths = [path for path in PATHS if path != "padded" or m < REORDERED_FROM_ROWS]
        each = {path: [float("inf")] * len(copied) for path in paths}  # seconds per projection
        for r in range(rounds):  # round 0 doubles as the warm-up (oneDNN makes its primitives): the smallest wins
            for path in paths[r % len(paths):] + paths[: r % len(paths)]:  # each path first in turn
                for k, (x, p) in enumerate(zip(xs, copied)):
                    start = time.perf_counter()
                    p.through(path, x)
                    each[path][k] = min(each[path][k], time.perf_counter() - start)
        for path in paths:
            for shape, seconds in zip(shapes, each[path]):
                ms[shape][path][i] = (ms[shape][path][i] or 0.0) + 1000 * seconds
    count = {shape: shapes.count(shape) for shape in ms}
    return ProductChoice(torch.get_num_threads(), {s: {p: tuple(t) for p, t in d.items()} for s, d in ms.items()},
                         count)
