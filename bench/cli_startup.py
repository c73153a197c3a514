"""Wall time of `hstap` start-up: `--help` of the CLI and of a few commands, median of --repeat runs.

    python bench/cli_startup.py --repeat 10

Each run is a fresh interpreter (what a user's shell pays); `import torch` alone is timed beside it for scale.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import harness

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
    ap = harness.parser(__doc__, device=None, repeat=10, warmup=1)
    args = ap.parse_args()
    run = harness.start(args)
    numbers = {}
    for name, argv in CASES.items():
        for _ in range(args.warmup):
            wall(argv)  # warm the page cache
        times = [wall(argv) for _ in range(args.repeat)]
        numbers[name] = {"median_ms": statistics.median(times) * 1000, "min_ms": min(times) * 1000,
                         "max_ms": max(times) * 1000}
        print(f"{name:<28} median {statistics.median(times) * 1000:6.0f} ms   (min {min(times) * 1000:.0f}, "
              f"max {max(times) * 1000:.0f}, {args.repeat} runs)")
    run.finish(numbers)


if __name__ == "__main__":
    main()
