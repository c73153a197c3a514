"""Resumable JSONL output: whole lines only, appended one `write` each, ids read back on open.

    with SynthWriter(Path("runs/synth.jsonl")) as w:
        if conv.id not in w.ids:
            w.write({"id": conv.id, "messages": [...], ...})
        w.fail(conv.id, "HTTP 500 after 3 retries")       # -> runs/synth.failed.jsonl

Crash-safety: each record is one `json.dumps(...) + "\\n"` handed to the kernel by `os.write` on an O_APPEND
descriptor, so a killed process (even SIGKILL) leaves every finished line in the file; only the line being
written can be cut short. On open, a trailing line without its newline is such a leftover: it is truncated
away and reported (`partial_bytes_removed`), and its conversation is regenerated. Lines are fsynced every
`fsync_every` records and on close, which bounds what a power loss (not a process kill) can take.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import TracebackType

from hstap.errors import HstapError
from hstap.faults import fault_point

_TAIL_CHUNK = 1 << 16


def failed_path(out: Path) -> Path:
    """`runs/x.jsonl` -> `runs/x.failed.jsonl`."""
    return out.with_suffix(".failed.jsonl")


class SynthWriter:
    """Appends records to `path` and failures to its `.failed.jsonl`; one writer per file (an flock guards it).

    Attributes:
        ids: ids already in the file (resume: skip these); grows as records are written.
        prompt_hashes: the `prompt_hash` of every record in the file (dedupe across runs).
        partial_bytes_removed: size of the cut-off last line found on open (0 if the file was whole).
        failed: records sent to the failed file by this run.
    """

    def __init__(self, path: Path, fsync_every: int = 16):
        self.path, self.fsync_every = path, fsync_every
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise HstapError(f"{path} is being written by another hstap synth run: wait for it or use another --out")
        self.partial_bytes_removed = self._cut_partial_tail()
        self.ids, self.prompt_hashes = self._scan()
        # failures are this run's only: a re-run retries every id missing from `path`, earlier failures included
        self._failed_fd = os.open(failed_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.failed = 0
        self._unsynced = 0

    def _cut_partial_tail(self) -> int:
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return 0
        end = size
        while end > 0:  # find the last newline, reading backwards in chunks
            start = max(0, end - _TAIL_CHUNK)
            chunk = os.pread(self._fd, end - start, start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)
        return size - keep

    def _scan(self) -> tuple[set[str], set[str]]:
        ids: set[str] = set()
        hashes: set[str] = set()
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    ids.add(record["id"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise HstapError(f"{self.path}:{lineno}: not a synth record (expected a JSON object with an "
                                     f"'id'): fix or remove that line, or choose another --out") from None
                if isinstance(record.get("prompt_hash"), str):
                    hashes.add(record["prompt_hash"])
        return ids, hashes

    def write(self, record: dict) -> None:
        """Append one record as one line; its id joins `ids`."""
        _write_all(self._fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self.ids.add(record["id"])
        if isinstance(record.get("prompt_hash"), str):
            self.prompt_hashes.add(record["prompt_hash"])
        self._unsynced += 1
        if self._unsynced >= self.fsync_every:
            os.fsync(self._fd)
            self._unsynced = 0
        fault_point("record-written")

    def fail(self, record_id: str, reason: str, **extra: object) -> None:
        """Append `{"id", "reason", ...extra}` to the failed file."""
        line = json.dumps({"id": record_id, "reason": reason, **extra}, ensure_ascii=False) + "\n"
        _write_all(self._failed_fd, line.encode("utf-8"))
        self.failed += 1

    def close(self) -> None:
        if self._fd < 0:
            return
        os.fsync(self._fd)
        os.fsync(self._failed_fd)
        os.close(self._failed_fd)
        os.close(self._fd)  # releases the flock
        self._fd = -1
        if self.failed == 0:
            failed_path(self.path).unlink(missing_ok=True)

    def __enter__(self) -> "SynthWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
