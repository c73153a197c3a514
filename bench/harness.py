"""The one small harness every benchmark in bench/ runs on: the shared flags, the device check, and one JSON
result that carries the hardware, the date, the exact command and the numbers.

    python bench/prefill.py --device cuda --lengths 128 512 --out prefill.json

Why one harness: each script used to print its own header (some the date, some the CPU's name, few the command),
so a figure in docs/benchmarks.md could not always be traced to what produced it. With `--out FILE.json` every
script now writes the same record, `{"benchmark", "date", "command", "hardware", "settings", "numbers"}`;
`numbers` is the script's own measurements (its docstring says what they are). A script imports this module as
`harness` (bench/ is the script's directory, first on sys.path when it runs as `python bench/NAME.py`).

Shared flags (each script takes the ones that apply to it):
- `--device`: cpu, cuda or cuda:N; a CUDA device on a machine without one is a one-line error, before any work;
- `--repeat` (alias `--reps`): timed repetitions (each script's docstring says how it sums them up);
- `--warmup`: untimed repetitions first;
- `--out FILE.json`: the record above (written by rank 0 only under torchrun).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

DEVICE_AUTO = "auto"  # `parser(device=DEVICE_AUTO)`: CUDA when the machine has it, else the CPU


def parser(doc: str, *, device: str | None = DEVICE_AUTO, repeat: int | None = None, warmup: int | None = None,
           **kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser described by the docstring's first line, with the shared flags: `--out` always;
    `--device` unless `device` is None (its default: "cpu", "cuda" or DEVICE_AUTO); `--repeat`/`--reps` and
    `--warmup` when given a default."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0], **kwargs)
    if device is not None:
        ap.add_argument("--device", default=default_device() if device == DEVICE_AUTO else device,
                        help="cpu, cuda or cuda:N (default: %(default)s)")
    if repeat is not None:
        ap.add_argument("--repeat", "--reps", dest="repeat", type=int, default=repeat,
                        help="timed repetitions (default: %(default)s)")
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup, help="untimed repetitions first (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                    help="also write the result as JSON: hardware, date, command, settings and numbers")
    return ap


def default_device() -> str:
    """"cuda" where torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> str:
    """`name` if this machine has that device; else a one-line SystemExit naming the flag and what is valid."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: this machine has no CUDA device (torch {torch.__version__}); "
                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise SystemExit(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return name


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def hardware(device: str | None) -> dict[str, Any]:
    """What ran the benchmark: the CPU, its cores and torch's threads, and the GPU where the device is CUDA."""
    import torch

    info: dict[str, Any] = {"device": device or "cpu", "cpu": cpu_name(), "cores": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                            "python": platform.python_version(), "platform": platform.platform()}
    if device and device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    return info


def describe(hw: dict[str, Any]) -> str:
    """One line of `hardware()` for a printed header."""
    where = f"{hw['gpu']}, CUDA {hw['cuda']}" if "gpu" in hw else f"{hw['cpu']}, {hw['cores']} cores"
    return f"{where}, torch {hw['torch']}, {hw['torch_threads']} torch threads"


def command_line() -> str:
    """The command as typed (`python bench/NAME.py ...`); under torchrun, whose own flags a worker cannot see,
    `torchrun --nproc_per_node N` and the script with its arguments."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return shlex.join(["torchrun", "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "?"), *sys.argv])
    return shlex.join(["python", *sys.argv])


def is_rank_zero() -> bool:
    """True outside torchrun and on its rank 0: one process prints the header and writes the record."""
    return os.environ.get("RANK", "0") == "0"


class Run:
    """One benchmark run: started after the arguments are parsed (`start`), ended with its numbers (`finish`)."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.args = args
        self.name = name
        self.date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.command = command_line()
        self.started = time.perf_counter()
        self.hardware = hardware(getattr(args, "device", None))

    def header(self) -> str:
        return f"date {self.date}, {describe(self.hardware)}\ncommand: {self.command}"

    def record(self, numbers: Any) -> dict[str, Any]:
        settings = {k: _plain(v) for k, v in vars(self.args).items() if k != "out"}
        return {"benchmark": self.name, "date": self.date, "command": self.command, "hardware": self.hardware,
                "settings": settings, "seconds": round(time.perf_counter() - self.started, 3),
                "numbers": _plain(numbers)}

    def finish(self, numbers: Any) -> dict[str, Any]:
        """The record; written to `--out` when given (rank 0 only), and that file's name printed."""
        record = self.record(numbers)
        out = getattr(self.args, "out", None)
        if out is not None and is_rank_zero():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1, allow_nan=True) + "\n")
            tmp.replace(out)  # whole or absent: an interrupted write leaves no half record
            print(f"wrote {out}")
        return record


def start(args: argparse.Namespace, *, header: bool = True) -> Run:
    """Check the device (one-line error), then print the header (date, hardware, command) unless told not to."""
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    run = Run(args, Path(sys.argv[0]).stem)
    if header and is_rank_zero():
        print(run.header(), flush=True)
    return run


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: paths and other objects as strings, tuples as lists, dict keys as strings."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor or numpy scalar
        return value.item()
    return str(value)
