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

Two stores are comparable only when their meta agree on what was captured: the model (weights fingerprint), the
layer ids, the hidden size and the teacher (`topk:K` or `hidden`). Otherwise the command says `DIFFERENT STORES:`
and what differs, in one line, exit 2, before reading a sample (stores of other layers used to MATCH on the teacher
alone; stores of other models ended in a tensor size error). The storage dtype may differ (an fp8 or fp32 capture
against a bf16 one: each tensor's tolerance follows the coarser dtype), and so may `extra` (how a capture was made:
an engine's route and its own layer ids, a capture's data source). MATCH also needs every tensor the two stores
share to have been compared: hidden states, the teacher's values and, for a top-k teacher, its token ids (equal
wherever the two stores' log-probs are not tied within the tensor's tolerance: `_topk_disagreement`).

    hstap compare runs/tp runs/one-gpu --reference runs/fp32     # two bf16 captures judged against an fp32 one

With `--reference R` the verdict asks another question: is each store as close to the truth as the other? Two bf16
captures of a deep model differ by more than bf16's rounding step even when both are right: every layer rounds, the
next layers carry the rounding on, and a tensor-parallel all-reduce rounds in its own order (two GPUs, an 8B shape:
5 % apart at layer 28; docs/distributed.md). So each of A and B is compared with R, a capture of the same
conversations computed in a finer dtype (`hstap capture --target-dtype fp32`), and passes when its error is within
`--within` times the other's (or within its dtype's tolerance, as above): MATCH means neither is measurably further
from R than the other. The cosine bound is scaled alike: 1 - cos grows as the error's square, so by `within`
squared. A fault — a wrong layer, a norm's epsilon, a scaled weight — puts one capture many times further from R
than the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hstap.config import cosine_floor, rounding_step
from hstap.errors import HstapError
from hstap.store.config import MATCH_MIN_COS, MATCH_RTOL, REFERENCE_WITHIN
from hstap.store.names import hidden_layer, hidden_name
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
    rtol: float = MATCH_RTOL
    min_cos: float = MATCH_MIN_COS
    reference: str | None = None  # --reference R: the verdict judges A and B each against R
    within: float = REFERENCE_WITHIN
    vs_reference: dict[str, dict[str, TensorStat]] = field(default_factory=dict)  # "A"/"B" -> tensor -> stat
    not_in_reference: list[str] = field(default_factory=list)  # common to A and B, absent from R: not judged
    uncompared: list[str] = field(default_factory=list)  # tensors both stores hold that no common sample compared

    def judged(self) -> dict[str, TensorStat]:
        """The statistics the verdict rests on, by label: A–B's own, or each store's against the reference."""
        if self.reference is None:
            return dict(self.tensors)
        return {f"{name} ({side} vs R)": st for side, stats in self.vs_reference.items() for name, st in stats.items()}

    @property
    def common_match(self) -> bool:
        """Every sample both stores hold agrees (and there is at least one)."""
        return (self.common > 0 and not self.token_mismatch and not self.uncompared
                and all(s.max_rel <= s.rtol and s.min_cos >= s.cos_floor for s in self.judged().values()))

    @property
    def ok(self) -> bool:
        return self.common_match and not self.only_a and not self.only_b and not self.not_in_reference

    @property
    def status(self) -> str:
        """`match` (exit 0), `common-match` (exit 3: extra samples on a side), `mismatch` (exit 1)."""
        return "match" if self.ok else "common-match" if self.common_match else "mismatch"

    def verdict(self) -> str:
        agree = (f"relative error within each tensor's tolerance (≥ {self.rtol:g}) and cosine ≥ its bound "
                 f"(≤ {self.min_cos:g}) on every tensor, identical tokens")
        if self.reference is not None:
            agree = (f"each store's error against the reference {self.reference} within {self.within:g}× the "
                     f"other's or its dtype's tolerance (≥ {self.rtol:g}) on every tensor, identical tokens")
        if self.ok:
            return f"verdict: MATCH — {self.common} samples, {agree}"
        extra = f"{len(self.only_a)} samples only in A, {len(self.only_b)} only in B"
        if self.not_in_reference:
            extra += f", {len(self.not_in_reference)} of the common ones not in the reference"
        if self.common_match:
            return (f"verdict: COMMON MATCH — all {self.common} common samples match ({agree}); {extra}, not "
                    "compared")
        why = []
        if self.common == 0:
            why.append("no common samples")
        if self.only_a or self.only_b or self.not_in_reference:
            why.append(extra)
        if self.token_mismatch:
            why.append(f"{len(self.token_mismatch)} samples with different tokens (first {self.token_mismatch[0]!r})")
        if self.uncompared and self.common > len(self.token_mismatch):
            why.append(f"not compared: {', '.join(self.uncompared)}")
        for name, s in self.judged().items():
            if name.startswith(TOPK_IDS) and s.max_rel > s.rtol:
                why.append(f"{name}: {s.max_rel:.1%} of the top-k ids differ where the log-probs are not tied "
                           f"(sample {s.worst_sample!r})")
            elif s.max_rel > s.rtol or s.min_cos < s.cos_floor:
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
    out = {hidden_name(k): t for k, t in sample["hidden"].items()}
    out.update({f"teacher.{k}": t for k, t in sample["teacher"].items() if t.is_floating_point()})
    return out


TOPK_IDS, TOPK_VALUES = "teacher.topk_ids", "teacher.topk_logprobs"


def _topk_disagreement(x: dict, y: dict, tol: float) -> dict[str, float]:
    """How far two top-k teachers' token ids disagree beyond ties. An id one store holds for a token must be among
    the other's ids for that token with about the same log-prob (within `tol` relative, at least `tol` absolute),
    so ids of tied log-probs may come in either order; or it may be missing there when its log-prob is about at or
    under the other's lowest kept one (a tie at the k-th place, which rounding may settle either way). Returns the
    compare's usual numbers: `rel` = the fraction of ids (of both stores) that break this, `max_abs` = how many.

    E.g. ids [7, 3] with log-probs [-0.5, -0.5] against [3, 7]: 0; ids [7, 3] at [-0.5, -2.0] against [8, 4]: 2 of 4
    (7 and 8 disagree; 3 and 4, at the lowest kept log-prob in both, may be a tie with each store's next id)."""
    ia, ib = x["teacher"]["topk_ids"], y["teacher"]["topk_ids"]  # (S, k) int32 each
    la, lb = x["teacher"]["topk_logprobs"].double(), y["teacher"]["topk_logprobs"].double()  # (S, k)
    same_id = ia[:, :, None] == ib[:, None, :]  # (S, k_a, k_b)
    atol = tol * torch.maximum(la[:, :, None].abs(), lb[:, None, :].abs()).clamp_min(1.0)  # (S, k_a, k_b)
    matched = same_id & ((la[:, :, None] - lb[:, None, :]).abs() <= atol)  # (S, k_a, k_b)
    low_a, low_b = la.min(-1, keepdim=True).values, lb.min(-1, keepdim=True).values  # (S, 1): lowest kept
    ok_a = matched.any(2) | (la <= low_b + tol * low_b.abs().clamp_min(1.0))  # (S, k_a)
    ok_b = matched.any(1) | (lb <= low_a + tol * low_a.abs().clamp_min(1.0))  # (S, k_b)
    wrong = int((~ok_a).sum() + (~ok_b).sum())
    total = ok_a.numel() + ok_b.numel()
    return {"max_abs": float(wrong), "rel": wrong / total if total else 0.0, "min_cos": 1.0}


def check_comparable(stores: dict[str, object], any_model: bool = False) -> None:
    """Raise `DIFFERENT STORES: …` (one line) when the stores' meta say they hold different things: another model,
    other layers, another hidden size, another teacher. `stores`: label → open Store, the first the reference point.

    An unknown fingerprint (`unknown` or empty: an engine capture configured without the checkpoint's files) is
    not held against a store; the storage dtype and `extra` never are (see the module docstring)."""
    (first_label, first), *others = stores.items()
    a = first.manifest.meta
    for label, store in others:
        b = store.manifest.meta
        differ = []
        known = {"", "unknown"}
        if not any_model and a.model_fingerprint not in known and b.model_fingerprint not in known \
                and a.model_fingerprint != b.model_fingerprint:
            differ.append(f"model {a.model_id} (fingerprint {a.model_fingerprint[:12]}) vs {b.model_id} "
                          f"(fingerprint {b.model_fingerprint[:12]})")
        if a.layer_ids != b.layer_ids:
            differ.append(f"layer ids {a.layer_ids} vs {b.layer_ids}")
        if a.hidden_size != b.hidden_size:
            differ.append(f"hidden size {a.hidden_size} vs {b.hidden_size}")
        if a.teacher != b.teacher:
            differ.append(f"teacher {a.teacher} vs {b.teacher}")
        if differ:
            raise HstapError(f"DIFFERENT STORES: {first_label} and {label} cannot be compared: {'; '.join(differ)} "
                             "(capture both from the same model with the same --layers and --teacher; --any-model when only the config "
                             "differs)")


def compare_stores(a: Path | str, b: Path | str, rtol: float = MATCH_RTOL, min_cos: float = MATCH_MIN_COS,
                   keep_per_sample: bool = False, reference: Path | str | None = None,
                   within: float = REFERENCE_WITHIN, any_model: bool = False) -> Comparison:
    """Compare the samples two stores have in common, tensor by tensor (and each against `reference`, if given).
    `any_model`: stores of different model fingerprints are compared too (the same weights under another config).

    Raises:
        HstapError: a directory is not a store, the two stores share no tensor name to compare, or the reference
            was computed in a dtype no finer than a store's.
    """
    sa, sb = open_store(a), open_store(b)
    sr = open_store(reference) if reference is not None else None
    check_comparable({str(a): sa, str(b): sb, **({f"--reference {reference}": sr} if sr is not None else {})},
                     any_model=any_model)
    ids_a, ids_b = sa.ids(), set(sb.ids())
    common = [i for i in ids_a if i in ids_b]
    names_a = {n for n in sa.manifest.tensors if _compared(n)}
    names_b = {n for n in sb.manifest.tensors if _compared(n)}
    if not names_a & names_b:
        raise HstapError(f"{a} has tensors {sorted(names_a)}, {b} has {sorted(names_b)}: nothing to compare "
                         "(capture both with the same --layers, and --teacher hidden for an engine capture)")
    result = Comparison(a=str(a), b=str(b), common=len(common), only_a=[i for i in ids_a if i not in ids_b],
                        only_b=sorted(ids_b - set(ids_a)), tensors={}, token_mismatch=[], rtol=rtol, min_cos=min_cos)
    if sr is not None:
        _check_finer(sr, reference, {a: sa, b: sb})
        in_reference = set(sr.ids())
        result.reference, result.within = str(reference), within
        result.not_in_reference = [i for i in common if i not in in_reference]
        common = [i for i in common if i in in_reference]
        result.common = len(common)
    for sid in common:
        x, y = sa[sa.index_of(sid)], sb[sb.index_of(sid)]
        pairs = {"A–B": (x, y, sa, sb)}
        if sr is not None:
            r = sr[sr.index_of(sid)]
            pairs.update({"A": (x, r, sa, sr), "B": (y, r, sb, sr)})
        if not all(_same_tokens(p, q) for p, q, _, _ in pairs.values()):
            result.token_mismatch.append(sid)
            continue
        for side, (p, q, sp, sq) in pairs.items():
            stats = result.tensors if side == "A–B" else result.vs_reference.setdefault(side, {})
            per_sample = _accumulate(stats, p, q, sp, sq, sid, rtol, min_cos)
            if keep_per_sample:
                prefix = "" if side == "A–B" else f"{side} vs R "
                result.per_sample.setdefault(sid, {}).update({prefix + k: v for k, v in per_sample.items()})
    if sr is not None:
        _bound_by_each_other(result.vs_reference, within)
    result.uncompared = sorted((names_a & names_b) - set(result.tensors))
    return result


def _same_tokens(x: dict, y: dict) -> bool:
    return torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])


def _accumulate(stats: dict[str, TensorStat], x: dict, y: dict, sx, sy, sid: str, rtol: float,
                min_cos: float) -> dict[str, dict[str, float]]:
    """Fold one sample's differences, tensor by tensor, into `stats`; return the sample's own numbers."""
    fx, fy = _flat(x), _flat(y)
    out = {}
    for name in sorted(fx.keys() & fy.keys()):
        st = out[name] = _stats(fx[name], fy[name])
        dtype = _coarser(sx, sy, name)
        agg = stats.setdefault(name, TensorStat(rtol=max(rtol, rounding_step(dtype)),
                                                cos_floor=min(min_cos, cosine_floor(dtype))))
        _fold(agg, st, sid)
    if "topk_ids" in x["teacher"] and "topk_ids" in y["teacher"]:
        tol = max(rtol, rounding_step(_coarser(sx, sy, TOPK_VALUES)))
        st = out[TOPK_IDS] = _topk_disagreement(x, y, tol)
        _fold(stats.setdefault(TOPK_IDS, TensorStat(rtol=0.0, cos_floor=0.0)), st, sid)  # no id may differ
    return out


def _fold(agg: TensorStat, st: dict[str, float], sid: str) -> None:
    """Fold one sample's numbers for one tensor into its worst case over the samples."""
    if st["rel"] > agg.max_rel or st["min_cos"] < agg.min_cos or not agg.worst_sample:
        agg.worst_sample = sid
    agg.max_abs, agg.max_rel = max(agg.max_abs, st["max_abs"]), max(agg.max_rel, st["rel"])
    agg.min_cos = min(agg.min_cos, st["min_cos"])


def _bound_by_each_other(vs_reference: dict[str, dict[str, TensorStat]], within: float) -> None:
    """Each store's tolerance against the reference: its dtype's, or `within` times the other store's error,
    whichever is larger (1 - cosine by `within` squared: it grows as the error's square)."""
    sides = list(vs_reference)
    if len(sides) != 2:
        return
    for me, other in (sides, sides[::-1]):
        for name, st in vs_reference[me].items():
            theirs = vs_reference[other].get(name)
            if theirs is None:
                continue
            st.rtol = max(st.rtol, within * theirs.max_rel)
            st.cos_floor = min(st.cos_floor, 1.0 - within ** 2 * (1.0 - theirs.min_cos))


def _check_finer(sr, reference, stores: dict) -> None:
    """A reference must be computed in a finer dtype than the captures it judges (where both manifests say)."""
    ref_dtype = sr.manifest.meta.extra.get("target_dtype")
    for path, store in stores.items():
        theirs = store.manifest.meta.extra.get("target_dtype")
        if ref_dtype and theirs and rounding_step(ref_dtype) >= rounding_step(theirs):
            raise HstapError(f"--reference {reference}: computed in {ref_dtype}, no finer than {path}'s {theirs}; "
                             "capture the reference with --target-dtype fp32")


def _coarser(sa, sb, name: str) -> str:
    """The dtype of tensor `name` with the coarser rounding step of the two stores'."""
    return max((store.manifest.tensors[name].dtype for store in (sa, sb)), key=rounding_step)


def format_comparison(c: Comparison, per_sample: bool = False) -> str:
    lines = [f"hstap compare {c.a} {c.b}: {c.common} common samples "
             f"({len(c.only_a)} only in A, {len(c.only_b)} only in B)",
             f"  {'tensor':<22} {'max|diff|':>12} {'max rel err':>12} {'tolerance':>10} {'min cosine':>12} "
             f"{'bound':>9}  worst sample"]
    tables = [("", c.tensors)]
    if c.reference is not None:
        lines[0] += f"; judged against the reference {c.reference} ({len(c.not_in_reference)} common not in it)"
        lines[1:1] = ["  A against B (shown; the verdict rests on the tables against the reference):"]
        tables += [(f"  {side} against the reference (tolerance: its dtype's, or {c.within:g}× the other's error):",
                    stats) for side, stats in c.vs_reference.items()]
    for title, stats in tables:
        if title:
            lines.append(title)
        for name, s in sorted(stats.items(), key=lambda kv: _order(kv[0])):
            lines.append(f"  {name:<22} {s.max_abs:>12.4g} {s.max_rel:>12.4g} {s.rtol:>10.3g} {s.min_cos:>12.6f} "
                         f"{s.cos_floor:>9.6g}  {s.worst_sample}")
    if per_sample:
        for sid, by_name in c.per_sample.items():
            for name, st in sorted(by_name.items(), key=lambda kv: _order(kv[0])):
                lines.append(f"    {sid:<20} {name:<16} max|diff| {st['max_abs']:.4g}  rel {st['rel']:.4g}  "
                             f"cos {st['min_cos']:.6f}")
    lines.append(c.verdict())
    return "\n".join(lines)


def _compared(name: str) -> bool:
    """Hidden states and teachers are compared; token ids, masks and fp8 scales are not."""
    return hidden_layer(name) is not None or name.startswith("teacher.")


def _order(name: str) -> tuple:
    """Hidden layers first, by layer id, then the rest by name."""
    layer = hidden_layer(name)
    return (layer is None, layer or 0, name)
