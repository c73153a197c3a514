"""Append an earlier session's regenerated answers to this session's, leaving out prompts answered again.

    python bench/merge_answers.py RUN/synth.jsonl PRIOR/synth0.jsonl [PRIOR/synth1.jsonl ...]   # prints counts

A prompt is the conversation before its last answer (every message but the final assistant one), compared by
content, not by record id: `hstap prompts` numbers Magpie prompts per run (magpie-0000001, ...) and names a code
prompt by function and task, so another seed reuses ids for different prompts. On 2026-12-03 (the twelfth GPU
run) an id match dropped ~4,700 Magpie and ~1,000 code answers to new prompts as "answered again", while it kept
~350 ShareGPT prompts seen before under other ids. Greedy answers to the same prompt are the same answer, so a
prompt answered in both sessions is kept once (this session's record).
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
    ap.add_argument("new", type=Path, help="this session's answers (JSONL), appended to in place")
    ap.add_argument("prior", type=Path, nargs="+", help="an earlier session's answers (JSONL)")
    args = ap.parse_args()
    print(json.dumps(merge(args.new, args.prior)))


if __name__ == "__main__":
    main()
