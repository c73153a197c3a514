"""`hstap compare DIR_A DIR_B`: are two stores of the same conversations the same hidden states?

    hstap compare runs/sglang runs/hf            # e.g. SGLang's capture against the transformers capture
    hstap compare runs/a runs/b --per-sample --json

Per tensor (hidden.k, teacher.*) and per common sample: max |a - b|, relative error ||a - b|| / ||b|| and the
lowest per-token cosine similarity; input_ids and loss_mask must be identical. The verdict is MATCH when every
common sample agrees within its tolerance and `--min-cos` and neither store has samples the other lacks (exit 0);
COMMON MATCH when every common sample agrees but a store has samples the other lacks (exit 3: the states agree,
the sample sets do not — e.g. one capture was cut short); MISMATCH otherwise (exit 1). A tensor's tolerance
follows its stored dtype (the coarser of the two stores'): `--rtol`, or the dtype's own rounding step where that
is larger (fp16 9.8e-4, bf16 7.8e-3, fp8 0.125; `hstap.config.rounding_step`), since two correct computations that
sum in another order (a tensor-parallel all-reduce, another kernel) may round one step apart; likewise the cosine
bound is `--min-cos` or the step's own 1 - step**2/2 where that is lower (fp8: 0.992; `hstap.config.cosine_floor`).
An fp8 store is read dequantised, so it compares against a bf16 capture of the same data directly. Layer ids are
compared as stored (canonical in both), so a store captured with an off-by-one layer convention shows up as a
large error on every layer, not as a silent pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hstap.config import cosine_floor, rounding_step
from hstap.errors import HstapError
from hstap.store.reader import open_store


@dataclass
class TensorStat:
    """Worst case of one tensor name over the common samples."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    min_cos: float = 1.0
    worst_sample: str = ""
    rtol: float = 0.0  # this tensor's tolerance: the requested rtol, or its dtype's rounding step if larger
    cos_floor: float = 1.0  # its cosine bound: the requested min_cos, or its dtype's cosine floor if lower


@dataclass
class Comparison:
    a: str
    b: str
    common: int
    only_a: list[str]
    only_b: list[str]
    tensors: dict[str, TensorStat]
    token_mismatch: list[str]
    per_sample: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    rtol: float = 1e-2
    min_cos: float = 0.999

    @property
    def common_match(self) -> bool:
        """Every sample both stores hold agrees (and there is at least one)."""
        return (self.common > 0 and not self.token_mismatch
                and all(s.max_rel <= s.rtol and s.min_cos >= s.cos_floor for s in self.tensors.values()))

    @property
    def ok(self) -> bool:
        return self.common_match and not self.only_a and not self.only_b

    @property
    def status(self) -> str:
        """`match` (exit 0), `common-match` (exit 3: extra samples on a side), `mismatch` (exit 1)."""
        return "match" if self.ok else "common-match" if self.common_match else "mismatch"

    def verdict(self) -> str:
        agree = (f"relative error within each tensor's tolerance (≥ {self.rtol:g}) and cosine ≥ its bound "
                 f"(≤ {self.min_cos:g}) on every tensor, identical tokens")
        if self.ok:
            return f"verdict: MATCH — {self.common} samples, {agree}"
        extra = f"{len(self.only_a)} samples only in A, {len(self.only_b)} only in B"
        if self.common_match:
            return (f"verdict: COMMON MATCH — all {self.common} common samples match ({agree}); {extra}, not "
                    "compared")
        why = []
        if self.common == 0:
            why.append("no common samples")
        if self.only_a or self.only_b:
            why.append(extra)
        if self.token_mismatch:
            why.append(f"{len(self.token_mismatch)} samples with different tokens (first {self.token_mismatch[0]!r})")
        for name, s in self.tensors.items():
            if s.max_rel > s.rtol or s.min_cos < s.cos_floor:
                why.append(f"{name}: rel err {s.max_rel:.3g} (tolerance {s.rtol:.3g}), cosine {s.min_cos:.6f} "
                           f"(bound {s.cos_floor:.6g}) (sample {s.worst_sample!r})")
        return "verdict: MISMATCH — " + "; ".join(why)


def _stats(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    x, y = x.double(), y.double()  # (S, H)
    diff = x - y
    rel = float(diff.norm() / y.norm().clamp_min(1e-12))
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1, eps=1e-12)  # (S,)
    return {"max_abs": float(diff.abs().max()), "rel": rel, "min_cos": float(cos.min())}


def _flat(sample: dict) -> dict[str, torch.Tensor]:
    out = {f"hidden.{k}": t for k, t in sample["hidden"].items()}
    out.update({f"teacher.{k}": t for k, t in sample["teacher"].items() if t.is_floating_point()})
    return out


def compare_stores(a: Path | str, b: Path | str, rtol: float = 1e-2, min_cos: float = 0.999,
                   keep_per_sample: bool = False) -> Comparison:
    """Compare the samples two stores have in common, tensor by tensor.

    Raises:
        HstapError: a directory is not a store, or the two stores share no tensor name to compare.
    """
    sa, sb = open_store(a), open_store(b)
    ids_a, ids_b = sa.ids(), set(sb.ids())
    common = [i for i in ids_a if i in ids_b]
    names_a = {n for n in sa.manifest.tensors if n.startswith(("hidden.", "teacher."))}
    names_b = {n for n in sb.manifest.tensors if n.startswith(("hidden.", "teacher."))}
    if not names_a & names_b:
        raise HstapError(f"{a} has tensors {sorted(names_a)}, {b} has {sorted(names_b)}: nothing to compare "
                         "(capture both with the same --layers, and --teacher hidden for an engine capture)")
    result = Comparison(a=str(a), b=str(b), common=len(common), only_a=[i for i in ids_a if i not in ids_b],
                        only_b=sorted(ids_b - set(ids_a)), tensors={}, token_mismatch=[], rtol=rtol, min_cos=min_cos)
    for sid in common:
        x, y = sa[sa.index_of(sid)], sb[sb.index_of(sid)]
        if not (torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])):
            result.token_mismatch.append(sid)
            continue
        fx, fy = _flat(x), _flat(y)
        for name in sorted(fx.keys() & fy.keys()):
            st = _stats(fx[name], fy[name])
            dtype = _coarser(sa, sb, name)
            agg = result.tensors.setdefault(name, TensorStat(rtol=max(rtol, rounding_step(dtype)),
                                                             cos_floor=min(min_cos, cosine_floor(dtype))))
            if st["rel"] > agg.max_rel or st["min_cos"] < agg.min_cos or not agg.worst_sample:
                agg.worst_sample = sid
            agg.max_abs, agg.max_rel = max(agg.max_abs, st["max_abs"]), max(agg.max_rel, st["rel"])
            agg.min_cos = min(agg.min_cos, st["min_cos"])
            if keep_per_sample:
                result.per_sample.setdefault(sid, {})[name] = st
    return result


def _coarser(sa, sb, name: str) -> str:
    """The dtype of tensor `name` with the coarser rounding step of the two stores'."""
    return max((store.manifest.tensors[name].dtype for store in (sa, sb)), key=rounding_step)


def format_comparison(c: Comparison, per_sample: bool = False) -> str:
    lines = [f"hstap compare {c.a} {c.b}: {c.common} common samples "
             f"({len(c.only_a)} only in A, {len(c.only_b)} only in B)",
             f"  {'tensor':<22} {'max|diff|':>12} {'max rel err':>12} {'tolerance':>10} {'min cosine':>12} "
             f"{'bound':>9}  worst sample"]
    for name, s in sorted(c.tensors.items(), key=lambda kv: _order(kv[0])):
        lines.append(f"  {name:<22} {s.max_abs:>12.4g} {s.max_rel:>12.4g} {s.rtol:>10.3g} {s.min_cos:>12.6f} "
                     f"{s.cos_floor:>9.6g}  {s.worst_sample}")
    if per_sample:
        for sid, by_name in c.per_sample.items():
            for name, st in sorted(by_name.items(), key=lambda kv: _order(kv[0])):
                lines.append(f"    {sid:<20} {name:<16} max|diff| {st['max_abs']:.4g}  rel {st['rel']:.4g}  "
                             f"cos {st['min_cos']:.6f}")
    lines.append(c.verdict())
    return "\n".join(lines)


def _order(name: str) -> tuple:
    head, _, tail = name.partition(".")
    return (head != "hidden", int(tail) if tail.isdigit() else 0, name)
