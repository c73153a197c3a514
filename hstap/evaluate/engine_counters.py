"""τ of a drafter that an engine serves, from vLLM's own speculative-decoding counters (Prometheus, `GET /metrics`).

    before = spec_decode_counters(client.get("/metrics").text)
    ...                                       # requests answered, `tokens` completion tokens after each one's first
    moved = moved_counters(lambda: spec_decode_counters(client.get("/metrics").text), before, tokens)
    tau = tokens / moved["decode_steps"]      # target forwards after each prefill, drafted or not

Used by the live parity test (tests/live/test_vllm_eagle.py) and bench/engine_speedup.py. τ counts as hstap's
evaluation counts it (docs/evaluate.md): tokens after the prefill's first, bonus token included, over verification
forwards. vLLM's own mean acceptance length, 1 + accepted / drafts, counts the last cycle uncut.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

COUNTERS = re.compile(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} (\S+)$",
                      re.MULTILINE)
# one observation per request per engine step that gave it tokens after its first (v1/metrics/stats.py): the
# decode forwards, whether the step verified a draft or not (prompt lookup finds no match on some steps)
DECODE_STEPS = re.compile(r"^vllm:inter_token_latency_seconds_count\{[^}]*\} (\S+)$", re.MULTILINE)


def spec_decode_counters(metrics: str) -> dict[str, float]:
    """`drafts`, `draft_tokens`, `accepted_tokens` (absent on a server that does not speculate) and `decode_steps`
    from a /metrics text, each summed over its label sets. EAGLE drafts on every decode step (drafts =
    decode_steps); prompt lookup only where the context repeats, so its τ needs `decode_steps`."""
    found: dict[str, float] = {}
    for m in COUNTERS.finditer(metrics):
        found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    for m in DECODE_STEPS.finditer(metrics):
        found["decode_steps"] = found.get("decode_steps", 0.0) + float(m.group(1))
    return found


def moved_counters(read: Callable[[], dict[str, float]], before: dict[str, float], tokens: int,
                   timeout_s: float = 10.0, poll_s: float = 0.1) -> dict[str, float]:
    """How far the counters moved since `before`, re-read until they account for `tokens` tokens (one per decode
    step plus the drafts accepted) or `timeout_s` passes: vLLM records a step's stats beside, not
    before, the response that step finished. Ask only a server that speculates: another never accounts for them."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = read()
        moved = {k: v - before.get(k, 0.0) for k, v in now.items()}
        steps = moved.get("decode_steps", moved.get("drafts", 0))
        if moved.get("accepted_tokens", 0) + steps >= tokens or time.monotonic() > deadline:
            return moved
        time.sleep(poll_s)
