"""`hstap prompts`: many prompts from varied sources, mixed by weight, every drop counted.

    hstap prompts --out runs/prompts.jsonl --total 3000 --source sharegpt:1 --source magpie:1 --source code:1
    hstap prompts --out runs/prompts.jsonl --total 30000 --device cuda --batch-size 256     # grow it on a GPU
    hstap synth --model smollm2 --data jsonl:runs/prompts.jsonl --turns all --out runs/synth.jsonl

Sources, run in the order given, each filling its share of `--total`:
- `sharegpt`: ShareGPT conversations (continuation chunks recovered), in an order drawn from the seed; the
  dataset's answers stay in the record (multi-turn chats must alternate) and `synth` replaces them.
- `code`: requests about functions and classes of this Python's standard library (hstap/data/code_tasks.py).
- `magpie`: user messages the target writes itself (hstap/synth/magpie.py), filtered and deduplicated.

ShareGPT and Magpie prompts share one deduper (exact and near duplicates); code requests are deduplicated per
unit of code. Each output line is `{"id", "messages", "source", "category", "meta"?}`; the counts go to the
provenance file beside it (hstap/synth/provenance.py). Re-running appends only what is missing: the same
settings give the same prompts, and a larger `--total` grows the file.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hstap.data import SkipReport, iter_sharegpt
from hstap.data.appender import JsonlAppender
from hstap.data.code import stdlib_units
from hstap.data.code_tasks import code_requests
from hstap.data.config import SOURCE_NAMES, PromptsConfig
from hstap.data.dedupe import Deduper
from hstap.data.types import Conversation
from hstap.errors import HstapError
from hstap.synth import provenance
from hstap.synth.magpie import MagpieSampler, attempt_of, judge
from hstap.synth.provenance import Tally


def user_text(messages: list[dict[str, str]]) -> str:
    """What a prompt asks: its user turns, joined (the deduper's view of a record)."""
    return "\n\n".join(m["content"] for m in messages if m["role"] == "user")


@dataclass
class FileState:
    """What the output file already holds, gathered while the appender reads it back."""

    dedupe: Deduper
    produced: dict[str, int] = field(default_factory=dict)
    categories: dict[str, dict[str, int]] = field(default_factory=dict)
    next_magpie_attempt: int = 0

    def see(self, record: dict) -> None:
        source = record.get("source")
        if source not in SOURCE_NAMES or not isinstance(record.get("messages"), list):
            raise HstapError(f"record {record.get('id')!r} has no 'source' of {', '.join(SOURCE_NAMES)} or no "
                             f"'messages': the file was not written by hstap prompts; choose another --out")
        self.count(source, record.get("category"))
        if source != "code":
            self.dedupe.admit(user_text(record["messages"]))
        attempt = attempt_of(record["id"]) if source == "magpie" else None
        if attempt is not None:
            self.next_magpie_attempt = max(self.next_magpie_attempt, attempt + 1)

    def count(self, source: str, category: object) -> None:
        self.produced[source] = self.produced.get(source, 0) + 1
        cats = self.categories.setdefault(source, {})
        cats[str(category)] = cats.get(str(category), 0) + 1


@dataclass
class PromptsResult:
    out: Path
    quotas: dict[str, int]
    tallies: dict[str, Tally]
    written: dict[str, int]
    resumed: int
    partial_bytes_removed: int
    seconds: float
    provenance: Path

    def summary(self) -> str:
        lines = [f"prompts: {sum(t.produced for t in self.tallies.values())} in {self.out} "
                 f"({sum(self.written.values())} written now, {self.resumed} already there)"]
        for name, quota in self.quotas.items():
            t = self.tallies[name]
            drops = ", ".join(f"{k}={v}" for k, v in sorted(t.dropped.items(), key=lambda kv: (-kv[1], kv[0])))
            short = f"; short by {quota - t.produced}" if t.produced < quota else ""
            lines.append(f"  {name:<8} requested {quota}, produced {t.produced} (examined {t.examined}, dropped "
                         f"{sum(t.dropped.values())}{': ' + drops if drops else ''}){short}")
        if self.partial_bytes_removed:
            lines.append(f"removed a cut-off last line ({self.partial_bytes_removed} bytes) left by an interrupted run")
        lines.append(f"provenance: {self.provenance}")
        return "\n".join(lines)


@dataclass
class _Run:
    cfg: PromptsConfig
    out: JsonlAppender
    state: FileState
    tallies: dict[str, Tally]
    doc: dict
    written: dict[str, int]

    def write(self, source: str, conv: Conversation) -> None:
        meta = dict(conv.meta)
        category = meta.pop("category", None)
        record = {"id": conv.id, "messages": conv.messages, "source": source, "category": category}
        if meta:
            record["meta"] = meta
        self.out.write(record)
        self.state.count(source, category)
        self.written[source] = self.written.get(source, 0) + 1

    def save(self) -> None:
        for name, tally in self.tallies.items():
            tally.produced = self.state.produced.get(name, 0)
            tally.categories = dict(sorted(self.state.categories.get(name, {}).items()))
        self.doc["sources"] = {name: asdict(t) for name, t in self.tallies.items()}
        provenance.write(self.cfg.provenance_path(), self.doc)


def build_prompts(cfg: PromptsConfig, target=None, progress: bool = True) -> PromptsResult:
    """Fill `cfg.out` up to each source's quota; returns the counts (also in the provenance file).

    `target`: an already loaded `hstap.models.Target` for Magpie instead of loading `cfg.model`."""
    from hstap.preflight import check_out_file

    check_out_file(cfg.out)  # a directory or a read-only place is named before anything is read or loaded
    start = time.perf_counter()
    path = cfg.provenance_path()
    previous = provenance.read(path)
    if previous is not None:
        provenance.check_same_settings(previous, cfg, path)
    state = FileState(Deduper(threshold=cfg.near_dup, seed=cfg.seed))
    with JsonlAppender(cfg.out, "hstap prompts", on_record=state.see) as out:
        resumed = len(out.ids)
        tallies = provenance.tallies_from(previous, path)
        notes = list(previous.get("notes", [])) if previous else []
        if previous is None and resumed:
            notes.append(f"{resumed} records were in the file without a provenance file: counts from before "
                         f"{time.strftime('%Y-%m-%d %H:%M')} are unknown")
        run_info = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": cfg.device,
                    "batch_size": cfg.batch_size, "partial_bytes_removed": out.partial_bytes_removed}
        runs = [*(previous.get("runs", []) if previous else []), run_info]
        doc = provenance.document(cfg, tallies, runs, previous.get("model") if previous else None, notes)
        run = _Run(cfg, out, state, tallies, doc, written={})
        quotas = cfg.quotas()
        for name, quota in quotas.items():
            tally = tallies.setdefault(name, Tally())
            tally.requested = quota
            if progress:
                print(f"hstap prompts: {name}: {quota} requested, {state.produced.get(name, 0)} in the file",
                      flush=True)
            _PASSES[name](run, tally, quota, target, progress)
            run.save()
        run_info.update(seconds=round(time.perf_counter() - start, 1), written=dict(run.written))
        run.save()
    return PromptsResult(out=cfg.out, quotas=quotas, tallies=tallies, written=run.written, resumed=resumed,
                         partial_bytes_removed=out.partial_bytes_removed, seconds=time.perf_counter() - start,
                         provenance=path)


def _fill(run: _Run, source: str, tally: Tally, quota: int, candidates: Iterable[Conversation],
          dedupe: Deduper | None, reject: Callable[[Conversation], str | None] | None = None) -> None:
    """Replay a fixed-order source from its start: keep what the file has, write new candidates until the quota,
    count every candidate passed over."""
    tally.examined, tally.kept, tally.dropped = 0, 0, {}
    for conv in candidates:
        if tally.kept >= quota:
            break
        tally.examined += 1
        if reject is not None and (reason := reject(conv)) is not None:
            tally.drop(reason)
            continue
        if conv.id not in run.out.ids:
            reason = dedupe.admit(user_text(conv.messages)) if dedupe is not None else None
            if reason is not None:
                tally.drop(reason)
                continue
            run.write(source, conv)
        tally.kept += 1


def _sharegpt(run: _Run, tally: Tally, quota: int, target, progress: bool) -> None:
    skips = SkipReport()
    convs = list(iter_sharegpt(report=skips, continuations=run.cfg.sharegpt_continuations))
    random.Random(run.cfg.seed).shuffle(convs)
    tally.take_report(skips)
    prompts = (Conversation(id=f"sharegpt-{c.id}", messages=c.messages, source="sharegpt",
                            meta={"category": "continuation" if c.meta.get("continuation") else "conversation"})
               for c in convs)
    _fill(run, "sharegpt", tally, quota, prompts, run.state.dedupe, _first_turn_cap(run.cfg.sharegpt_max_chars))


def _first_turn_cap(max_chars: int | None) -> Callable[[Conversation], str | None] | None:
    """The reason a conversation is passed over when its first user turn is longer than `max_chars`: a long
    prompt costs prefill and capture positions, not answers, which is all a small run has time for."""
    if max_chars is None:
        return None

    def reject(conv: Conversation) -> str | None:
        first = next((m["content"] for m in conv.messages if m["role"] == "user"), "")
        return f"first_turn_over_{max_chars}_chars" if len(first) > max_chars else None

    return reject


def _code(run: _Run, tally: Tally, quota: int, target, progress: bool) -> None:
    cfg, skips = run.cfg, SkipReport()
    units = stdlib_units(min_lines=cfg.code_min_lines, max_lines=cfg.code_max_lines,
                         packages=tuple(cfg.code_packages), report=skips)
    requests = code_requests(units, seed=cfg.seed, tasks_per_unit=cfg.code_tasks_per_unit, near_dup=cfg.near_dup,
                             report=skips)
    _fill(run, "code", tally, quota, requests, None)
    tally.take_report(skips)  # after the pass: near duplicates are found lazily


def _magpie(run: _Run, tally: Tally, quota: int, target, progress: bool) -> None:
    cfg = run.cfg
    # The provenance says where the last whole round ended; a run killed inside the next round left some of that
    # round's prompts in the file, and redoing the round (same seed, same samples) skips them by id, so every
    # attempt is counted once. Without a provenance, the file's highest attempt is all there is to go by.
    attempt = tally.next_attempt if tally.next_attempt is not None else run.state.next_magpie_attempt
    cap = math.ceil(cfg.max_attempts * quota)
    if run.state.produced.get("magpie", 0) >= quota or attempt >= cap:
        return
    if target is None:
        from hstap.models import load_target

        target = load_target(cfg.model, device=cfg.device)
    _check_model(run, target)
    sampler = MagpieSampler(target, seed=cfg.seed, batch_size=cfg.batch_size, temperature=cfg.temperature,
                            top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, cuda_graphs=cfg.cuda_graphs)
    try:
        while run.state.produced.get("magpie", 0) < quota and attempt < cap:
            for cand in sampler.round(attempt):
                _take(run, tally, quota, cand, sampler.special_strings)
            attempt += cfg.batch_size
            tally.next_attempt = tally.examined = attempt
            tally.kept = run.state.produced.get("magpie", 0)
            run.save()  # a crash loses at most this round's counting, never a written prompt
            if progress:
                print(f"  magpie: {tally.kept}/{quota} kept after {attempt} samples", flush=True)
    finally:
        sampler.close()
    if tally.kept < quota:
        tally.notes.append(f"stopped at {attempt} samples (max_attempts {cfg.max_attempts:g} x {quota}) with "
                           f"{tally.kept} prompts kept")


def _take(run: _Run, tally: Tally, quota: int, cand, special_strings: list[str]) -> None:
    conv = cand.conversation()
    if conv.id in run.out.ids:
        return  # written by a run that stopped before it saved this round's counts: already kept
    if run.state.produced.get("magpie", 0) >= quota:
        tally.drop("surplus")  # the round sampled more than the quota still needed
        return
    reason = judge(cand, run.cfg.filters, run.state.dedupe, special_strings)
    if reason is not None:
        tally.drop(reason)
    else:
        run.write("magpie", conv)


def _check_model(run: _Run, target) -> None:
    model = {"name": run.cfg.model, "id": target.model_id, "fingerprint": target.fingerprint}
    before = run.doc.get("model")
    if before and before.get("fingerprint") != model["fingerprint"]:
        raise HstapError(f"{run.cfg.out}: its Magpie prompts come from model weights {before['fingerprint']}, "
                         f"--model {run.cfg.model} now has {model['fingerprint']}: choose another --out")
    run.doc["model"] = model


_PASSES = {"sharegpt": _sharegpt, "code": _code, "magpie": _magpie}
assert set(_PASSES) == set(SOURCE_NAMES), "every source name has a pass"
