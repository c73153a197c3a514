"""Crash-safe JSONL appending: whole lines only, one `write` each, ids read back on open.

    with JsonlAppender(Path("prompts.jsonl"), "hstap prompts", on_record=seen.append) as out:
        if rec["id"] not in out.ids:
            out.write(rec)

Each record is one `json.dumps(...) + "\\n"` handed to the kernel by `os.write` on an O_APPEND descriptor, so a
killed process (even SIGKILL) leaves every finished line in the file; only the line being written can be cut
short. On open, a trailing line without its newline is such a leftover: it is truncated away and reported
(`partial_bytes_removed`), and the caller produces that record again. Lines are fsynced every `fsync_every`
records and on close, which bounds what a power loss (not a process kill) can take. A write that fails (a full
disk: ENOSPC, a quota, an I/O error) is rolled back to the last whole line and raised as a one-line HstapError:
every record before it stays, and a re-run resumes after them. `hstap synth` and `hstap prompts` both write
through this class.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from hstap.errors import HstapError
from hstap.faults import fault_point

_TAIL_CHUNK = 1 << 16


class JsonlAppender:
    """Appends records to `path`; one appender per file (an flock guards it).

    `command` names the writer in errors ("hstap synth"); `on_record` sees every record already in the file, in
    order, so a caller can rebuild its own state (hashes, counts) without reading the file twice.

    Attributes:
        ids: ids already in the file (resume: skip these); grows as records are written.
        partial_bytes_removed: size of the cut-off last line found on open (0 if the file was whole).
    """

    def __init__(self, path: Path, command: str, fsync_every: int = 16,
                 on_record: Callable[[dict], None] | None = None):
        self.path, self.fsync_every = path, fsync_every
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise HstapError(f"{path} is being written by another {command} run: wait for it or use another --out")
        try:
            self.partial_bytes_removed = self._cut_partial_tail()
            self.ids = self._scan(command, on_record)
        except BaseException:
            os.close(self._fd)
            raise
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

    def _scan(self, command: str, on_record: Callable[[dict], None] | None) -> set[str]:
        ids: set[str] = set()
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    ids.add(record["id"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise HstapError(f"{self.path}:{lineno}: not a record ({command} writes JSON objects with an "
                                     f"'id'): fix or remove that line, or choose another --out") from None
                if on_record is not None:
                    on_record(record)
        return ids

    def write(self, record: dict) -> None:
        """Append one record as one line; its id joins `ids`. HstapError (file whole as before) if it fails."""
        append_line(self._fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"), self.path,
                    f"the {len(self.ids)} records before it are whole and kept", fault="record-write")
        self.ids.add(record["id"])
        self._unsynced += 1
        if self._unsynced >= self.fsync_every:
            sync(self._fd, self.path)
            self._unsynced = 0
        fault_point("record-written")

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            sync(self._fd, self.path)
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = -1

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def append_line(fd: int, data: bytes, path: Path, kept: str, fault: str | None = None) -> None:
    """Append `data` (whole lines) to the O_APPEND `fd` of `path`, or leave the file as it was and raise a one-line
    HstapError: a short write followed by ENOSPC would otherwise leave half a line for the next run to trim.
    `fault`: the HSTAP_FAULT point passed just before the write (`record-write:N:enospc`: the disk is full)."""
    size = os.fstat(fd).st_size
    try:
        if fault:
            fault_point(fault)
        write_all(fd, data)
    except OSError as exc:
        os.ftruncate(fd, size)
        raise HstapError(f"{path}: {exc.strerror or exc} while appending a line; {kept}: free space, "
                         "then re-run the same command to resume") from None


def sync(fd: int, path: Path) -> None:
    """fsync, a failure (ENOSPC on a filesystem that allocates late, EIO) as a one-line HstapError."""
    try:
        os.fsync(fd)
    except OSError as exc:
        raise HstapError(f"{path}: {exc.strerror or exc} while syncing it to disk: free space or check the disk, "
                         "then re-run the same command to resume") from None


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out (a write to a file may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
