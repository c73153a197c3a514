"""`hstap synth`: regenerate the assistant turns of a chat source with the target itself.

    hstap synth --model smollm2 --data sharegpt --limit 1000 --out runs/synth.jsonl
    hstap synth --server http://127.0.0.1:30000 --data jsonl:prompts.jsonl --turns all --out runs/synth.jsonl
    hstap capture --data jsonl:runs/synth.jsonl ...

Each output line is one conversation in the generic chat format (`id`, `messages`) with the dataset's answers
replaced by the target's, plus provenance: `source_id`, `source`, `model`, `sampling`, `finish_reason`, token
counts, per-turn details, `prompt_hash` and the source's `meta` if any. With `--turns all` every user turn is
answered in order, the target's own earlier answers in the context. Re-running the same command appends only
the missing ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from hstap.data import Conversation, SkipReport, open_source
from hstap.errors import HstapError
from hstap.metrics import tokens_per_second
from hstap.preflight import check_device, check_out_file
from hstap.progress import progress_bar
from hstap.synth.backend import Backend, PermanentFailure, RequestFailed, TurnSampling
from hstap.synth.config import SynthConfig
from hstap.synth.writer import SynthWriter, failed_path


@dataclass
class SynthResult:
    out: Path
    written: int
    resumed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    report: SkipReport
    partial_bytes_removed: int
    permanent: dict[str, int] = field(default_factory=dict)  # failures a re-run cannot fix, by reason

    def summary(self) -> str:
        rate = tokens_per_second(self.completion_tokens, self.seconds)
        lines = [
            f"synth: wrote {self.written} conversations ({self.prompt_tokens} prompt + {self.completion_tokens} "
            f"completion tokens, {rate:.0f} generated tok/s) to {self.out}",
            f"resumed past {self.resumed} conversations already in {self.out.name}" if self.resumed else "",
            f"removed a cut-off last line ({self.partial_bytes_removed} bytes) left by an interrupted run"
            if self.partial_bytes_removed else "",
            f"dropped: {self.report.summary()}",
            f"failed {self.failed}: see {failed_path(self.out)}; re-run the same command to retry them"
            if self.failed else "",
            f"not retried {sum(self.permanent.values())}: they can never succeed as asked ("
            + ", ".join(f"{k}={v}" for k, v in sorted(self.permanent.items()))
            + f"): see {failed_path(self.out)} (\"retry\": false)" if self.permanent else "",
        ]
        return "\n".join(line for line in lines if line)


def prompt_hash(conv: Conversation, turns: str) -> str:
    """sha256 of the turns the target is asked to answer (system + user turns; the first user turn only for
    `first`): two records with the same hash would be the same generation."""
    asked, users = [], 0
    for m in conv.messages:
        if m["role"] == "user":
            users += 1
            if turns == "first" and users > 1:
                break
        if m["role"] != "assistant":
            asked.append([m["role"], m["content"]])
    return hashlib.sha256(json.dumps(asked, ensure_ascii=False).encode("utf-8")).hexdigest()[:32]


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """A per-request seed that is stable across runs (Python's hash() is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(f"{conv_id}/{turn}".encode("utf-8"))) % 2**31


async def answer(conv: Conversation, backend: Backend, cfg: SynthConfig) -> tuple[dict | None, str | None]:
    """(record, None), or (None, drop reason). Raises RequestFailed with the turn it failed at."""
    messages: list[dict[str, str]] = []
    turns: list[dict] = []
    for m in conv.messages:
        if m["role"] == "assistant":
            continue  # the dataset's answer: replaced by the target's own
        if m["role"] == "user" and turns and cfg.turns == "first":
            break
        messages.append({"role": m["role"], "content": m["content"]})
        if m["role"] != "user":
            continue
        sampling = TurnSampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                seed=turn_seed(cfg.seed, conv.id, len(turns)))
        try:
            done = await backend.complete(messages, sampling)
        except PermanentFailure as exc:
            raise PermanentFailure(f"turn {len(turns)}: {exc}", exc.reason) from None
        except RequestFailed as exc:
            raise RequestFailed(f"turn {len(turns)}: {exc}") from None
        if not done.content.strip():
            return None, "empty_answer"
        if done.finish_reason == "length" and cfg.drop_truncated:
            return None, "truncated_answer"
        messages.append({"role": "assistant", "content": done.content})
        turns.append({"finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
                      "completion_tokens": done.completion_tokens})
    record = {"id": conv.id, "messages": messages, "source_id": conv.id, "source": conv.source,
              "model": backend.model_id, "sampling": cfg.sampling(), "finish_reason": turns[-1]["finish_reason"],
              "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
              "completion_tokens": sum(t["completion_tokens"] for t in turns), "turns": turns,
              "prompt_hash": prompt_hash(conv, cfg.turns)}
    if conv.meta:
        record["meta"] = conv.meta  # e.g. MT-bench's category, for later grouping
    return record, None


def select(convs: list[Conversation], writer: SynthWriter, cfg: SynthConfig, report: SkipReport) -> list[Conversation]:
    """The conversations still to generate: not already written, first of their prompt hash."""
    todo, seen = [], set(writer.prompt_hashes)
    for conv in convs:
        if conv.id in writer.ids:
            continue
        h = prompt_hash(conv, cfg.turns)
        if h in seen:
            report.add("duplicate_prompt")
            continue
        seen.add(h)
        todo.append(conv)
    return todo


async def synthesize(todo: list[Conversation], backend: Backend, writer: SynthWriter, cfg: SynthConfig,
                     report: SkipReport, progress: bool = True) -> tuple[int, int, int]:
    """Answer `todo` with `cfg.in_flight` conversations at a time; returns (written, prompt, completion tokens).

    Records are written as they finish; a request that fails after its retries sends the conversation to the
    failed file. A fatal error (e.g. a server serving another model) cancels the rest and propagates.
    """
    pending = iter(todo)
    totals = [0, 0, 0]
    bar = progress_bar(total=len(todo), unit="conv", desc="synth", disable=not progress)

    async def worker() -> None:
        for conv in pending:  # shared iterator: each conversation is taken by exactly one worker
            try:
                record, reason = await answer(conv, backend, cfg)
            except PermanentFailure as exc:
                writer.fail(conv.id, str(exc), permanent=exc.reason, source=conv.source)
            except RequestFailed as exc:
                writer.fail(conv.id, str(exc), source=conv.source)
            else:
                if record is None:
                    report.add(reason)
                else:
                    writer.write(record)
                    totals[0] += 1
                    totals[1] += record["prompt_tokens"]
                    totals[2] += record["completion_tokens"]
            bar.update(1)

    tasks = [asyncio.create_task(worker()) for _ in range(min(cfg.in_flight, max(1, len(todo))))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        bar.close()
    return totals[0], totals[1], totals[2]


def run_synth(cfg: SynthConfig, progress: bool = True, target=None) -> SynthResult:
    """Generate the missing records of `cfg.out` from `cfg.data` with the embedded target or the servers.

    `target`: an already loaded `hstap.models.Target` to use instead of loading `cfg.model` (embedded only).
    """
    check_out_file(cfg.out)  # before the source is read and the model loads: a bad --out fails at once
    if cfg.backend == "embedded" and target is None:
        check_device(cfg.device)
    report = SkipReport()
    convs = list(open_source(cfg.data, limit=cfg.limit, report=report))
    if not convs:
        raise HstapError(f"--data {cfg.data}: no usable conversations ({report.summary()})")
    with SynthWriter(cfg.out) as writer:
        todo = select(convs, writer, cfg, report)
        resumed = sum(c.id in writer.ids for c in convs)
        print(f"hstap synth: {len(todo)} conversations to generate ({resumed} already in {cfg.out}) "
              f"with {cfg.backend} backend, {cfg.in_flight} in flight", flush=True)
        start = time.perf_counter()
        totals = asyncio.run(_run_backend(cfg, todo, writer, report, progress, target))
        written, prompt_tokens, completion_tokens = totals
        seconds = time.perf_counter() - start
    return SynthResult(out=cfg.out, written=written, resumed=resumed, failed=writer.failed,
                       prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, seconds=seconds,
                       report=report, partial_bytes_removed=writer.partial_bytes_removed,
                       permanent=dict(writer.permanent))


async def _run_backend(cfg: SynthConfig, todo: list[Conversation], writer: SynthWriter, report: SkipReport,
                       progress: bool, target) -> tuple[int, int, int]:
    if not todo:
        return 0, 0, 0
    if cfg.backend == "server":
        from hstap.synth.server import ServerBackend

        async with ServerBackend(cfg.servers, model=cfg.model, timeout=cfg.timeout, retries=cfg.retries,
                                 backoff=cfg.backoff, max_connections=cfg.in_flight, seed=cfg.seed) as backend:
            return await synthesize(todo, backend, writer, cfg, report, progress)
    from hstap.models import load_target
    from hstap.synth.embedded import EmbeddedBackend

    if target is None:
        target = load_target(cfg.model, device=cfg.device)
    backend = EmbeddedBackend(target, max_batch=cfg.batch_size, cuda_graphs=cfg.cuda_graphs,
                              compile_step=cfg.compile_step, continuous=cfg.continuous)
    # similar lengths side by side: batches pad less (records are written in completion order anyway)
    todo = sorted(todo, key=lambda c: sum(len(m["content"]) for m in c.messages if m["role"] != "assistant"))
    try:
        return await synthesize(todo, backend, writer, cfg, report, progress)
    finally:
        backend.close()
