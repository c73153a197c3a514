"""Resumable JSONL output: whole lines only, appended one `write` each, ids read back on open.

    with SynthWriter(Path("runs/synth.jsonl")) as w:
        if conv.id not in w.ids:
            w.write({"id": conv.id, "messages": [...], ...})
        w.fail(conv.id, "HTTP 500 after 3 retries")       # -> runs/synth.failed.jsonl (a re-run retries it)
        w.fail(conv.id, "prompt of 9000 tokens ...", permanent="over_model_positions")   # can never succeed

Crash-safety comes from `hstap.data.appender.JsonlAppender` (one `os.write` per whole line on an O_APPEND
descriptor, a cut-off last line truncated away on open and reported as `partial_bytes_removed`, fsync every
`fsync_every` records and on close); this class adds the failed file and the prompt hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType

from hstap.data.appender import JsonlAppender, append_line, sync


def failed_path(out: Path) -> Path:
    """`runs/x.jsonl` -> `runs/x.failed.jsonl`."""
    return out.with_suffix(".failed.jsonl")


class SynthWriter:
    """Appends records to `path` and failures to its `.failed.jsonl`; one writer per file (an flock guards it).

    Attributes:
        ids: ids already in the file (resume: skip these); grows as records are written.
        prompt_hashes: the `prompt_hash` of every record in the file (dedupe across runs).
        partial_bytes_removed: size of the cut-off last line found on open (0 if the file was whole).
        failed: records sent to the failed file by this run that a re-run may get (timeouts, server errors).
        permanent: {reason: count} of records sent there that can never succeed as asked (a prompt longer than
            the model's positions, a request the server rejects as malformed): a re-run would fail them again.
    """

    def __init__(self, path: Path, fsync_every: int = 16):
        self.path = path
        self.prompt_hashes: set[str] = set()
        self._lines = JsonlAppender(path, "hstap synth", fsync_every, on_record=self._remember)
        self.partial_bytes_removed = self._lines.partial_bytes_removed
        self.ids = self._lines.ids
        # failures are this run's only: a re-run retries every id missing from `path`, earlier failures included
        self._failed_fd = os.open(failed_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.failed = 0
        self.permanent: dict[str, int] = {}

    def _remember(self, record: dict) -> None:
        if isinstance(record.get("prompt_hash"), str):
            self.prompt_hashes.add(record["prompt_hash"])

    def write(self, record: dict) -> None:
        """Append one record as one line; its id joins `ids`."""
        self._lines.write(record)
        self._remember(record)

    def fail(self, record_id: str, reason: str, permanent: str | None = None, **extra: object) -> None:
        """Append `{"id", "reason", "retry", ...extra}` to the failed file; `permanent` names why retrying is
        pointless (`"retry": false` in the file), otherwise a re-run of the same command retries it."""
        entry = {"id": record_id, "reason": reason, "retry": permanent is None, **extra}
        if permanent is not None:
            entry["permanent"] = permanent
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        failed = failed_path(self.path)
        append_line(self._failed_fd, line.encode("utf-8"), failed, f"the {self.failures} failures before it are kept")
        if permanent is None:
            self.failed += 1
        else:
            self.permanent[permanent] = self.permanent.get(permanent, 0) + 1

    @property
    def failures(self) -> int:
        """Lines in the failed file: retryable and permanent."""
        return self.failed + sum(self.permanent.values())

    def close(self) -> None:
        if self._failed_fd < 0:
            return
        try:
            self._lines.close()
            sync(self._failed_fd, failed_path(self.path))
        finally:
            os.close(self._failed_fd)
            self._failed_fd = -1
        if self.failures == 0:
            failed_path(self.path).unlink(missing_ok=True)

    def __enter__(self) -> "SynthWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

