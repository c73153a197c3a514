"""Checks of a command's environment that need no model, run before anything slow loads: a missing GPU or an
`--out` that cannot be written is a one-line error in the first second, not a traceback after the model load (or
after hours of work, at the first write).

    check_device("cuda:1")            # is that device here? (its spelling was checked by the config: hstap.config.Device)
    check_out_dir(Path("runs/cap"))   # a directory this run can create or write into
    check_out_file(Path("s.jsonl"))   # a file this run can create or append to

Every command that takes `--device` or an output path calls these (capture, synth, prompts, train, eval, export,
store merge, serve's `--run-dir`; `load_target` checks the device too), so the same bad flag reads the same
everywhere. Writable means: the nearest existing directory grants write access (access(2), which answers for root
too on a read-only mount or an immutable directory) and is not on a kernel filesystem (/proc, /sys, cgroup…),
where root passes access(2) and then cannot create a file at all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hstap.errors import HstapError


def check_device(device: str, flag: str = "--device") -> None:
    """`device` (cpu, cuda, cuda:N) exists on this machine; HstapError naming the flag otherwise."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
        raise HstapError(f"{flag} {device}: {why} (torch {torch.__version__}); use --device cpu")
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        raise HstapError(f"{flag} {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# Kernel filesystems: they hold no regular files a process could create, yet access(2) says yes to root on them
KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                                "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "nsfs", "mqueue", "devpts",
                                "autofs", "rpc_pipefs", "hugetlbfs"})


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` (an existing path) lives on, from /proc/self/mountinfo (the longest mount
    point above it, the last mounted winning); None where that cannot be read (not Linux)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real, best, found = os.path.realpath(path), -1, None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[4])  # mountinfo escapes ' ' as \040
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, found = len(point), rest.split()[0]
    return found


def _not_writable(directory: Path) -> str | None:
    """Why files cannot be made in `directory`, or None. access(2) answers for root too on a read-only mount; a
    kernel filesystem is named by its type."""
    kind = filesystem_type(directory)
    if kind in KERNEL_FILESYSTEMS:
        return f"{kind}, a kernel filesystem that holds no regular files"
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def _check_creatable(path: Path, within: Path, flag: str, what: str) -> None:
    """`path` (a `what`) can be made in `within` or its nearest existing ancestor."""
    existing = _nearest_existing(within)
    if not existing.is_dir():
        raise HstapError(f"{flag} {path}: {existing} is a file, so the {what} cannot be created there")
    why = _not_writable(existing)
    if why:
        raise HstapError(f"{flag} {path}: cannot write in {existing} ({why}): choose a writable directory")


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """`path` is a directory, or can become one, that this process can write into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HstapError(f"{flag} {path}: is a file, expected a directory: choose another path")
    _check_creatable(path, path, flag, "directory")


def check_out_file(path: Path, flag: str = "--out") -> None:
    """`path` is a file, or can become one, that this process can append to."""
    path = Path(path)
    if path.is_dir():
        raise HstapError(f"{flag} {path}: is a directory, expected a file path")
    if not path.exists():
        _check_creatable(path, path.parent, flag, "file")
    elif not os.access(path, os.W_OK) or filesystem_type(path) in KERNEL_FILESYSTEMS:
        why = _not_writable(path.parent) or "permission denied"
        raise HstapError(f"{flag} {path}: cannot write to it ({why}): choose a writable file")
