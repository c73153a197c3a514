"""A drafter's weights get the store's integrity treatment: a checksum written when they are saved, and every load
checks it, the safetensors header and that every number is finite, naming the file in one line.

    save_pretrained(run_dir)         # model.safetensors, then checksum.json: {"file", "sha256", "bytes"}
    state = load_weights(run_dir)    # checksum (when there is one), header, finite weights → the tensors

Every command that loads a drafter reads it through `load_weights`: `hstap eval --drafter`, `hstap serve --engine hf
--drafter` (checked by `hstap serve` itself before the engine starts, so the error is said once), `hstap export`
and `hstap train --init-from`. A flipped byte reads as a valid but wrong drafter, and a NaN in `fc.weight` drafts
nothing (τ 1.00 with no warning): both are refused here instead of measured.

Drafters saved before checksums existed (no checksum.json) still load: their header and finiteness are checked,
which finds a truncated, empty or damaged file and a NaN, but not a flipped byte inside a weight. The shipped
drafters carry a checksum.json of their unpacked weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hstap.errors import HstapError
from hstap.store.reader import sha256_file

WEIGHTS = "model.safetensors"
CHECKSUM = "checksum.json"  # {"file": "model.safetensors", "sha256": hex, "bytes": n}, as a store's manifest lists
RESTORE = "restore the drafter from a good copy or train it again"


def checksum_record(weights: Path) -> dict:
    """What checksum.json holds for `weights`: its name, sha256 and size."""
    return {"file": WEIGHTS, "sha256": sha256_file(weights), "bytes": weights.stat().st_size}


def write_checksum(run_dir: Path, record: dict) -> None:
    """Write `record` (`checksum_record`) as `run_dir`/checksum.json, atomically (temp file, fsync, rename)."""
    from hstap.store.manifest import atomic_write

    atomic_write(Path(run_dir) / CHECKSUM, (json.dumps(record) + "\n").encode())


def verify_checksum(run_dir: Path) -> bool:
    """Check `run_dir`/model.safetensors against its checksum.json: True when it matches, False when there is no
    checksum.json (a drafter saved before checksums existed).

    Raises:
        HstapError: checksum.json unreadable, or the file's size or sha256 differs from the recorded ones.
    """
    run_dir = Path(run_dir)
    path, weights = run_dir / CHECKSUM, run_dir / WEIGHTS
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
        want_sha, want_bytes = str(record["sha256"]), int(record["bytes"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise HstapError(f"{path}: not a checksum record ({type(exc).__name__}: {exc}); expected "
                         '{"file": "model.safetensors", "sha256": ..., "bytes": ...} as `hstap train` writes it: '
                         f"delete it to load the drafter unchecked, or {RESTORE}") from None
    size = weights.stat().st_size
    if size != want_bytes:
        raise HstapError(f"{weights}: {size:,} bytes, {CHECKSUM} recorded {want_bytes:,} when it was saved "
                         f"(truncated or replaced since): {RESTORE}")
    got = sha256_file(weights)
    if got != want_sha:
        raise HstapError(f"{weights}: sha256 {got[:16]}… differs from the {want_sha[:16]}… {CHECKSUM} recorded when "
                         f"it was saved (its contents changed since): {RESTORE}")
    return True


def read_safetensors(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of `weights`, or one line naming it when it is missing, empty, truncated or its header damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = Path(weights)
    if not weights.is_file():
        raise HstapError(f"{weights}: missing (a drafter directory holds config.json and {WEIGHTS}, as `hstap train` "
                         "writes them)")
    if weights.stat().st_size == 0:
        raise HstapError(f"{weights}: empty (0 bytes), expected a drafter's safetensors weights: {RESTORE}")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HstapError(f"{weights}: not readable as safetensors ({detail}), expected a drafter's whole weights "
                         f"file: {RESTORE}") from None


def check_finite(state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse weights holding NaN or inf, naming the tensors: such a drafter drafts nothing useful and says nothing
    about it. One `isfinite().all()` per tensor (a pass over 100 MB takes ~0.1 s)."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        counts = ", ".join(f"{name} ({int((~torch.isfinite(state[name])).sum()):,} of {state[name].numel():,} "
                           "values)" for name in bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise HstapError(f"{where}: non-finite weights (NaN or inf) in {counts}, expected finite numbers: {RESTORE}")


def load_weights(run_dir: Path | str) -> dict[str, torch.Tensor]:
    """`run_dir`/model.safetensors checked (checksum when recorded, header, finite numbers) and loaded."""
    run_dir = Path(run_dir)
    weights = run_dir / WEIGHTS
    if weights.is_file():
        verify_checksum(run_dir)
    state = read_safetensors(weights)
    check_finite(state, weights)
    return state


def check_drafter(run_dir: Path | str) -> None:
    """Everything `load_weights` checks, plus a readable config.json, without building the model: what a command
    that hands the drafter to another process (`hstap serve --drafter`) runs first, so a damaged drafter is one line
    from that command instead of a crash of the engine it started."""
    from hstap.drafter.config import DrafterConfig

    DrafterConfig.load(Path(run_dir) / "config.json")
    load_weights(run_dir)
