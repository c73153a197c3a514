"""Size estimates before a capture starts, so a run fails in its first second rather than at 95 % of a full disk.

    from hstap.store import bytes_per_token, check_free_space
    need = bytes_per_token(conventional_specs(meta)) * planned_tokens     # the one bytes-per-token rule
    warning = check_free_space("runs/cap", need, force=False)     # raises HstapError when short
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from hstap.errors import HstapError
from hstap.store.manifest import StoreMeta, TensorSpec, torch_dtype
from hstap.store.names import hidden_name, scale_name

HEADROOM = 1.1  # manifests, the in-flight shard's temporary file, and estimate error


def human_bytes(n: float) -> str:
    """Decimal units like `df -H`: 1.5 GB, 320 MB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable: the loop returns at TB")


def bytes_per_token(tensors: dict[str, TensorSpec]) -> int:
    """On-disk bytes one token costs: the sum of itemsize x per-token elements over all tensor names."""
    total = 0
    for spec in tensors.values():
        total += torch_dtype(spec.dtype).itemsize * math.prod(spec.shape)
    return total


def teacher_hidden_dtype(hidden_dtype: str) -> str:
    """The dtype of a `hidden` teacher: the hidden dtype, except bf16 under fp8 (the training target is not
    quantised; hstap.store.fp8)."""
    return "bf16" if hidden_dtype == "fp8" else hidden_dtype


def conventional_specs(meta: StoreMeta) -> dict[str, TensorSpec]:
    """The specs a conventional capture writes, known before the first sample (for `--plan` estimates).

    Hidden states in the hidden dtype; under fp8 each layer also has `hidden_scale.{k}` (one fp32 per token).
    Teachers: `topk:K` (K int32 ids and K fp16 log-probs, as the capture tap stores them) or `hidden` (the final
    hidden state in `teacher_hidden_dtype`).
    """
    specs = {"input_ids": TensorSpec(dtype="int32", shape=[]), "loss_mask": TensorSpec(dtype="bool", shape=[])}
    for k in meta.layer_ids:
        specs[hidden_name(k)] = TensorSpec(dtype=meta.hidden_dtype, shape=[meta.hidden_size])
        if meta.hidden_dtype == "fp8":
            specs[scale_name(k)] = TensorSpec(dtype="fp32", shape=[])
    if meta.teacher.kind == "topk":
        specs["teacher.topk_ids"] = TensorSpec(dtype="int32", shape=[meta.teacher.k])
        specs["teacher.topk_logprobs"] = TensorSpec(dtype="fp16", shape=[meta.teacher.k])
    else:
        specs["teacher.hidden"] = TensorSpec(dtype=teacher_hidden_dtype(meta.hidden_dtype), shape=[meta.hidden_size])
    return specs


def capture_specs(layer_ids: list[int], hidden_size: int, dtype: str, teacher) -> dict[str, TensorSpec]:
    """`conventional_specs` before any StoreMeta exists: what a capture of these layers and teacher writes."""
    meta = StoreMeta(model_id="", model_fingerprint="", layer_ids=layer_ids, hidden_size=hidden_size,
                     hidden_dtype=dtype, teacher=teacher)
    return conventional_specs(meta)


def projected_bytes(bytes_per_token: float, tokens_per_sample: float, samples: int) -> float:
    """Disk a store of `samples` samples will take at this measured rate and mean sample length."""
    return bytes_per_token * tokens_per_sample * samples


def _existing_parent(path: Path) -> Path:
    # The output directory usually does not exist yet; its nearest existing parent is on the same filesystem.
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_free_space(path: Path | str, needed_bytes: int, force: bool = False) -> str | None:
    """Refuse a capture that would not fit; print nothing, let the caller decide how to show the result.

    Returns:
        None when the space suffices, else (with `force`) a one-line warning for the caller to print.
    Raises:
        HstapError: free space < needed x 1.1 and not `force`.
    """
    where = _existing_parent(Path(path))
    free = shutil.disk_usage(where).free
    if free >= needed_bytes * HEADROOM:
        return None
    msg = f"need ~{human_bytes(needed_bytes * HEADROOM)} in {path}, only {human_bytes(free)} free"
    if not force:
        raise HstapError(f"{msg}: free space or pass --force")
    return f"{msg} (continuing: --force)"
