"""Wall time of `hstap` start-up: `--help` of the CLI and of a few commands, median of --reps runs.

    python bench/cli_startup.py --reps 10

Each run is a fresh interpreter (what a user's shell pays); `import torch` alone is timed beside it for scale.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "hstap --help": ["-m", "hstap.cli", "--help"],
    "hstap train --help": ["-m", "hstap.cli", "train", "--help"],
    "hstap capture --help": ["-m", "hstap.cli", "capture", "--help"],
    "python -c 'import torch'": ["-c", "import torch"],
}


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for name, argv in CASES.items():
        wall(argv)  # warm the page cache
        times = [wall(argv) for _ in range(args.reps)]
        print(f"{name:<28} median {statistics.median(times) * 1000:6.0f} ms   (min {min(times) * 1000:.0f}, "
              f"max {max(times) * 1000:.0f}, {args.reps} runs)")


if __name__ == "__main__":
    main()
