"""Structural rules every chat source applies, so ShareGPT and JSONL records are judged the same way.

A valid conversation: optional system turn first, then user/assistant strictly alternating starting with the
user, no empty or whitespace-only turn. A trailing user turn is kept: it is what a prompts-only file (and
MT-bench) looks like, the renderer masks it out of the loss, and a generation stage can answer it.
"""

from __future__ import annotations

from hstap.data.types import ROLES


def message_problem(messages: list[dict[str, str]]) -> str | None:
    """The skip reason for `messages` (already mapped to system/user/assistant), or None if they are valid."""
    if not messages:
        return "empty_conversation"
    if any(m["role"] not in ROLES for m in messages):
        return "bad_role"
    if any(not m["content"].strip() for m in messages):
        return "empty_turn"
    if any(m["role"] == "system" for m in messages[1:]):
        return "misplaced_system"
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    if not turns:
        return "no_user_turn"
    if turns[0]["role"] != "user":
        return "first_not_user"
    for k, m in enumerate(turns):
        if m["role"] != ("user" if k % 2 == 0 else "assistant"):
            return "not_alternating"
    return None
