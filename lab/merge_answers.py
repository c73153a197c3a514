"""Append an earlier session's regenerated answers to this session's, leaving out prompts answered again; and,
before synth, leave out of a prompt set the first turns an earlier session already answered.

    python lab/merge_answers.py merge RUN/synth.jsonl PRIOR/synth0.jsonl [PRIOR/synth1.jsonl ...]
    python lab/merge_answers.py unanswered RUN/prompts.jsonl RUN/new_prompts.jsonl PRIOR/synth0.jsonl ...

Both print their counts as one JSON line.

A prompt is the conversation before its last answer (every message but the final assistant one), compared by
content, not by record id: `hstap prompts` numbers Magpie prompts per run (magpie-0000001, ...) and names a code
prompt by function and task, so another seed reuses ids for different prompts. On 2026-12-03 (the twelfth GPU
run) an id match dropped ~4,700 Magpie and ~1,000 code answers to new prompts as "answered again", while it kept
~350 ShareGPT prompts seen before under other ids. Greedy answers to the same prompt are the same answer, so a
prompt answered in both sessions is kept once (this session's record). The pools run dry: 4,816 of the 19,891
seed-7 prompts (ShareGPT above all, whose first turns number ~15k in the packaged dataset) had been answered in the
seed-6 session, so `unanswered` saves synth that share of its time-boxed run.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterator
from pathlib import Path


def _key(messages: list[dict]) -> str:
    """Messages as canonical JSON (role and content of each): the one form both keys below compare in."""
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


def prompt_key(record: dict, where: str) -> str:
    """The conversation before the record's last answer."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    return _key(messages[:-1] if messages[-1].get("role") == "assistant" else messages)


def first_turn_key(record: dict, where: str) -> str:
    """What `hstap synth --turns first` answers of a prompt record: its messages up to the first user turn, keyed
    as `prompt_key` keys that answer."""
    messages = record.get("messages")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"] if isinstance(messages, list) else []
    if not users:
        raise ValueError(f"{where}: field 'messages' must be a list of {{role, content}} objects with a user turn")
    return _key(messages[: users[0] + 1])


def _records(path: Path) -> Iterator[tuple[str, str, dict]]:
    """(where, line with its newline, record) of every non-blank line of a JSONL file."""
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e.msg}); expected one object per line") from None
            yield f"{path}:{n}", line if line.endswith("\n") else line + "\n", record


def unanswered(prompts: Path, out: Path, prior: list[Path]) -> dict[str, int]:
    """Write to `out` the records of `prompts` whose first turn no `prior` answer file answers (first-turn synth);
    → counts: prompts, kept, answered_before, and answered_before per record `source` (how dry each pool runs)."""
    answered = {prompt_key(record, where) for path in prior for where, _, record in _records(path)}
    total, kept, by_source = 0, 0, collections.Counter()
    with out.open("w") as w:
        for where, line, record in _records(prompts):
            total += 1
            if first_turn_key(record, where) in answered:
                by_source[str(record.get("source", "?"))] += 1
                continue
            w.write(line)
            kept += 1
    return {"prompts": total, "kept": kept, "answered_before": total - kept,
            "answered_before_by_source": dict(sorted(by_source.items()))}


def merge(new: Path, prior: list[Path]) -> dict[str, int]:
    """Append to `new` every record of the `prior` files whose prompt `new` does not hold yet (nor an earlier prior
    record); → counts: this_session, prior_added, prior_answered_again (the prior records left out)."""
    mine = [prompt_key(record, where) for where, _, record in _records(new)]
    seen, added, again = set(mine), 0, 0
    with new.open("a") as out:
        for path in prior:
            for where, line, record in _records(path):
                key = prompt_key(record, where)
                if key in seen:
                    again += 1
                    continue
                seen.add(key)
                out.write(line)
                added += 1
    return {"this_session": len(mine), "prior_added": added, "prior_answered_again": again}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="append the prior answers to prompts NEW does not answer")
    m.add_argument("new", type=Path, help="this session's answers (JSONL), appended to in place")
    m.add_argument("prior", type=Path, nargs="+", help="an earlier session's answers (JSONL)")
    u = sub.add_parser("unanswered", help="the prompts whose first turn no prior answer file answers")
    u.add_argument("prompts", type=Path, help="a prompt set (JSONL, hstap prompts)")
    u.add_argument("out", type=Path, help="where the unanswered ones go")
    u.add_argument("prior", type=Path, nargs="+", help="an earlier session's answers (JSONL)")
    args = ap.parse_args()
    if args.command == "merge":
        print(json.dumps(merge(args.new, args.prior)))
    else:
        print(json.dumps(unanswered(args.prompts, args.out, args.prior)))


if __name__ == "__main__":
    main()
