"""Drafters that ship inside the package, by name, wherever a drafter directory is taken:

    hstap train --online ... --init-from smollm2-recipe     # continue the GPU recipe's drafter
    hstap eval --drafter smollm2-recipe --bench mt-bench --chain 3 --out runs/eval-recipe
    hstap eval --drafter reference ...                       # the same: the embedded target's reference drafter

A drafter trained from zero stops where one run's steps leave it, and τ keeps rising with the tokens trained
(docs/benchmarks.md: about +0.2 chain-3 τ per doubling), so the recipe's drafter ships in the package and each
training run can add its steps to the last one's (lab/ship_drafter.py replaces it). A shipped drafter is a
`hstap train` run directory whose weights are xz-compressed (`model.safetensors.xz`: 29 MB of bf16 → 21 MB);
`resolve_drafter` unpacks it once into the model cache (`$HSTAP_CACHE/drafters/NAME-SHA12`) and returns that
directory. `provenance.json` beside it says what trained it and what it measured; `checksum.json` holds the
unpacked weights' sha256, which every load checks (hstap.drafter.integrity).
"""

from __future__ import annotations

import lzma
import os
import shutil
from pathlib import Path

from hstap.drafter.integrity import sha256_file
from hstap.errors import HstapError

SHIPPED = Path(__file__).parent / "shipped"
PACKED = "model.safetensors.xz"
# "reference": the embedded target's reference drafter (issue 12: once the recipe's drafter beat prompt lookup by
# >= 1.0 tau on MT-bench; its figures against prompt lookup are in docs/benchmarks.md)
ALIASES = {"reference": "smollm2-recipe"}


def shipped_names() -> list[str]:
    """The shipped drafters' names, aliases included."""
    names = [d.name for d in SHIPPED.iterdir() if (d / PACKED).is_file()] if SHIPPED.is_dir() else []
    return sorted(names + [alias for alias, name in ALIASES.items() if name in names])


def resolve_drafter(spec: Path | str, flag: str = "--drafter") -> Path:
    """A drafter directory as given, or the unpacked directory of the shipped drafter named `spec`."""
    path = Path(spec)
    return path if path.exists() else unpack(_shipped(spec, flag))


def drafter_config_path(spec: Path | str, flag: str = "--drafter") -> Path:
    """The config.json of the drafter `spec` names, a shipped one's read where it ships: its size is known (for
    `--plan`, before anything loads) without unpacking its weights."""
    path = Path(spec)
    return (path if path.exists() else _shipped(spec, flag)) / "config.json"


def _shipped(spec: Path | str, flag: str) -> Path:
    if str(spec) not in shipped_names():
        names = ", ".join(shipped_names()) or "none"
        raise HstapError(f"{flag} {spec}: no such directory, and no shipped drafter of that name (shipped: {names})")
    return SHIPPED / ALIASES.get(str(spec), str(spec))


def unpack(src: Path) -> Path:
    """`src`'s drafter as a plain run directory in the cache, unpacked once per content (the name carries the
    archive's hash, so a newer shipped drafter never meets an older one's files); written to a temporary
    directory and renamed into place, so concurrent or killed unpacks never leave a torn one."""
    from hstap.models.target import cache_root

    packed = src / PACKED
    digest = sha256_file(packed)[:12]
    dest = cache_root() / "drafters" / f"{src.name}-{digest}"
    if (dest / "model.safetensors").is_file():
        _add_missing(src, dest)
        return dest
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for extra in src.iterdir():
            if extra.name != PACKED and extra.is_file():
                shutil.copy2(extra, tmp / extra.name)
        try:
            with lzma.open(packed) as f_in, open(tmp / "model.safetensors", "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 1 << 20)
        except (lzma.LZMAError, EOFError) as e:
            raise HstapError(f"{packed}: not a whole xz archive ({e}); restore it from git") from None
        try:
            os.replace(tmp, dest)
        except OSError:  # another process unpacked the same archive first: keep its copy
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _add_missing(src: Path, dest: Path) -> None:
    """Copy into an unpacked drafter the small files shipped since it was unpacked (checksum.json, 2026-12: the
    weights of a cache unpacked before it would load unchecked), each renamed into place whole."""
    for extra in src.iterdir():
        if extra.name != PACKED and extra.is_file() and not (dest / extra.name).exists():
            tmp = dest / f".{extra.name}.tmp{os.getpid()}"
            shutil.copy2(extra, tmp)
            os.replace(tmp, dest / extra.name)
