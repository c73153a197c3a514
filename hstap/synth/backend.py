"""What a synth backend returns and how it fails: shared by the embedded and the server backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Completion:
    """One answer from the target. `completion_tokens` counts what it generated, the stop token included."""

    content: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TurnSampling:
    """Sampling parameters of one request."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


class RequestFailed(Exception):
    """A request that could not be answered (after every retry); the record goes to `.failed.jsonl`, and a re-run
    of the same command retries it."""


class PermanentFailure(RequestFailed):
    """A request that can never succeed as asked (`reason`: `over_model_positions`, `rejected_by_server`): listed
    in `.failed.jsonl` with `"retry": false` and reported apart, so nobody re-runs hoping it will pass."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Backend(Protocol):
    """Answers chat requests; `model_id` is what the records name as their model."""

    model_id: str

    async def complete(self, messages: list[dict[str, str]], sampling: TurnSampling) -> Completion:
        """The target's answer to `messages` (ending with a user turn); raises RequestFailed."""
        ...
