"""Append an earlier session's regenerated answers to this session's, leaving out prompts answered again; and,
before synth, leave out of a prompt set the first turns an earlier session already answered.

    python bench/merge_answers.py merge RUN/synth.jsonl PRIOR/synth0.jsonl [PRIOR/synth1.jsonl ...]
    python bench/merge_answers.py unanswered RUN/prompts.jsonl RUN/new_prompts.jsonl PRIOR/synth0.jsonl ...

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
import json
from pathlib import Path


def prompt_key(record: dict, where: str) -> str:
    """The conversation before the record's last answer, as canonical JSON (role and content of each message)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    if messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


def first_turn_key(record: dict, where: str) -> str:
    """What `hstap synth --turns first` answers of a prompt record: its messages up to the first user turn, keyed
    as `prompt_key` keys that answer."""
    messages = record.get("messages")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"] if isinstance(messages, list) else []
    if not users:
        raise ValueError(f"{where}: field 'messages' must be a list of {{role, content}} objects with a user turn")
    return json.dumps([[m.get("role"), m.get("content")] for m in messages[: users[0] + 1]], ensure_ascii=False)


def _answered(paths: list[Path]) -> set[str]:
    keys = set()
    for path in paths:
        with path.open() as f:
            for n, line in enumerate(f, 1):
                keys.add(prompt_key(json.loads(line), f"{path}:{n}"))
    return keys


def unanswered(prompts: Path, out: Path, prior: list[Path]) -> dict[str, int]:
    """Write to `out` the records of `prompts` whose first turn no `prior` answer file answers (first-turn synth);
    → counts: prompts, kept, answered_before."""
    answered, total, kept = _answered(prior), 0, 0
    with prompts.open() as f, out.open("w") as w:
        for total, line in enumerate(f, 1):
            if first_turn_key(json.loads(line), f"{prompts}:{total}") in answered:
                continue
            w.write(line if line.endswith("\n") else line + "\n")
            kept += 1
    return {"prompts": total, "kept": kept, "answered_before": total - kept}


def merge(new: Path, prior: list[Path]) -> dict[str, int]:
    """Append to `new` every record of the `prior` files whose prompt `new` does not hold yet (nor an earlier prior
    record); → counts: this_session, prior_added, prior_answered_again (the prior records left out)."""
    seen, this_session = set(), 0
    with new.open() as f:
        for this_session, line in enumerate(f, 1):
            seen.add(prompt_key(json.loads(line), f"{new}:{this_session}"))
    added = again = 0
    with new.open("a") as out:
        for path in prior:
            with path.open() as f:
                for n, line in enumerate(f, 1):
                    key = prompt_key(json.loads(line), f"{path}:{n}")
                    if key in seen:
                        again += 1
                        continue
                    seen.add(key)
                    out.write(line if line.endswith("\n") else line + "\n")
                    added += 1
    return {"this_session": this_session, "prior_added": added, "prior_answered_again": again}


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
