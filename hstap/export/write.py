"""Write a trained drafter as a checkpoint SGLang or vLLM loads as an EAGLE-3 draft model.

    hstap export --drafter runs/drafter --format sglang --out runs/drafter-sglang
    python -m sglang.launch_server --model-path /ckpt --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path runs/drafter-sglang ...

    from hstap.export.write import export_drafter
    export_drafter("runs/drafter", "vllm", "runs/drafter-vllm")   # -> Path of the written directory

The output directory holds `config.json` (the engine's), `model.safetensors` and `hstap.json` (provenance: the
canonical layer ids, the target's id and fingerprint). It appears whole or not at all (written beside, renamed),
and only once it reads back as the drafter it came from (hstap.export.check: layer ids as each engine derives
them, config keys, every tensor bit for bit, d2t/t2d, provenance).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from hstap.drafter.config import DrafterConfig
from hstap.errors import HstapError
from hstap.config import Dtype
from hstap.export.check import problems, read_drafter
from hstap.export.formats import CHECKED_VERSIONS, EMBEDDING, get_format
from hstap.preflight import check_out_dir


def _provenance(cfg: DrafterConfig, fmt: str, dtype: str, config: dict, drafter_dir: Path,
                include_embedding: bool) -> dict:
    return {
        "hstap_export": 1,
        "format": fmt,
        "dtype": dtype,
        "include_embedding": include_embedding,
        "aux_layer_ids": cfg.aux_layer_ids,  # canonical: the residual stream after decoder layer k
        "engine_layer_ids": {"sglang": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                             "vllm": config["eagle_aux_hidden_state_layer_ids"]},
        "target_model_id": cfg.target_model_id,
        "target_fingerprint": cfg.target_fingerprint,
        "target_num_layers": cfg.target_num_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "source": str(drafter_dir),
        "checked_against": CHECKED_VERSIONS,
    }


def _prepare_out(out: Path, drafter_dir: Path, force: bool) -> None:
    if out.resolve() == drafter_dir.resolve():
        raise HstapError(f"--out {out} is the drafter directory itself: choose another directory")
    check_out_dir(out)
    found = _not_an_export(out)
    if found:  # --force replaces an export, never the work of another command
        raise HstapError(f"--out {out} holds {found}: --force only replaces an export; choose another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HstapError(f"--out {out} exists and is not empty: choose another directory or pass --force")
    check_out_dir(out.parent, flag=f"--out {out}: its parent")  # the export is written beside it, then renamed


def _not_an_export(out: Path) -> str:
    """What in `out` says it is a capture store or a training run (which --force would delete), or ''."""
    from hstap.store.manifest import MANIFEST_NAME, shard_files
    from hstap.train.rundir import RUN_MARKS

    if not out.is_dir():
        return ""
    store = ([MANIFEST_NAME] if (out / MANIFEST_NAME).exists() else []) + [p.name for p in shard_files(out)[:2]]
    if store:
        return f"a capture store ({', '.join(store)})"
    run = [name for name in RUN_MARKS if (out / name).exists()]
    return f"a training run ({', '.join(run)})" if run else ""


def _write_atomic(out: Path, config: dict, tensors: dict[str, torch.Tensor], provenance: dict,
                  drafter: tuple[DrafterConfig, dict[str, torch.Tensor]]) -> None:
    """Write into a sibling temp directory, check it reads back as `drafter`, then rename it into place (the old
    one moved aside first). A failure (a full disk, a failed check) leaves `out` as it was and no temp behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    old = None
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "hstap.json").write_text(json.dumps(provenance, indent=2) + "\n")
        found = problems(tmp, *drafter)
        if found:
            raise HstapError(f"the export does not read back as the drafter, nothing written to {out}: {found[0]}")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_drafter(drafter_dir: Path | str, fmt: str, out_dir: Path | str, dtype: Dtype = "bf16",
                   include_embedding: bool = False, force: bool = False) -> Path:
    """Write `drafter_dir` (a training run) as an `fmt` ("sglang" or "vllm") EAGLE-3 draft checkpoint.

    Args:
        drafter_dir: directory with the drafter's config.json and model.safetensors.
        fmt: a key of FORMATS.
        out_dir: the directory to create; an existing non-empty one needs `force`.
        dtype: floating-point weights are cast to it (bf16, fp16, fp32); d2t stays int64, t2d bool.
        include_embedding: also write `embed_tokens.weight`. Neither engine needs it (both share the target's);
            SGLang reads it from the draft checkpoint only under pipeline parallelism.
        force: replace a non-empty `out_dir`.
    Returns:
        The output directory.
    Raises:
        HstapError: unknown format or dtype, an unreadable or inconsistent drafter, ids the engine cannot
            capture, or an output directory in the way.
    """
    build = get_format(fmt)
    if dtype not in ("bf16", "fp16", "fp32"):
        raise HstapError(f"unknown export dtype {dtype!r}: expected one of bf16, fp16, fp32")
    drafter_dir, out = Path(drafter_dir), Path(out_dir)
    _prepare_out(out, drafter_dir, force)  # before reading the weights: a bad --out fails at once
    cfg, state = read_drafter(drafter_dir)
    if include_embedding and EMBEDDING not in state:
        raise HstapError(f"{drafter_dir}/model.safetensors has no {EMBEDDING}: export without --with-embedding")
    config, tensors = build(cfg, state, dtype=dtype, include_embedding=include_embedding)
    try:
        _write_atomic(out, config, tensors, _provenance(cfg, fmt, dtype, config, drafter_dir, include_embedding),
                      (cfg, state))
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as SafetensorError
        why = getattr(exc, "strerror", None) or str(exc)
        raise HstapError(f"--out {out}: {why} while writing the export; nothing was written (an earlier "
                         f"{out.name} is left as it was)") from None
    return out
