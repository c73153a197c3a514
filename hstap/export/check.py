"""Re-load an export as the engines read it and check it against the drafter it came from: train/serve parity.

    hstap export --drafter runs/drafter --out runs/drafter-vllm --check     # an existing export, any time
    export_drafter(...)                                                     # checks every export before it appears

A drafter served with other layers than it was trained on (an id off by one in one engine's convention), a norm
the engine silently initialises to ones, or a draft→target map shifted by one still serves — at a τ near 1,
found weeks later. Here each is a one-line error naming the field: the layer ids each engine derives from
config.json (SGLang from `eagle_config`, +1 itself; vLLM from the top-level key, its own +1 convention), every
config key the loaders read, every tensor (name, shape, dtype, value: the export's cast of the drafter's weights,
bit for bit), d2t/t2d, and the provenance in hstap.json (canonical ids, target fingerprint). With a store, the
store's layers, hidden size and target must be the ones the export will be fed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hstap.drafter.config import DrafterConfig
from hstap.drafter.integrity import load_weights
from hstap.errors import HstapError
from hstap.config import torch_dtype
from hstap.export.formats import EMBEDDING, draft_config, draft_tensors, expected_shapes

FILES = ("config.json", "model.safetensors", "hstap.json")


def read_drafter(drafter_dir: Path | str) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A training run directory's (or a shipped drafter's: `reference`) config and tensors, checked against the
    shapes the config implies."""
    from hstap.drafter.shipped import resolve_drafter, shipped_names

    run = Path(drafter_dir)
    if not run.exists() and str(drafter_dir) in shipped_names():
        run = resolve_drafter(drafter_dir)  # what `hstap eval --drafter reference` evaluates, exported as is
    if not run.is_dir():
        raise HstapError(f"{run}: no such drafter directory (expected a run directory written by `hstap train`)")
    cfg = DrafterConfig.load(run / "config.json")
    weights = run / "model.safetensors"
    state = load_weights(run)  # checksum, header and finite numbers, as every drafter load (hstap.drafter.integrity)
    _check_state(cfg, state, weights)
    return cfg, state


def _check_state(cfg: DrafterConfig, state: dict[str, torch.Tensor], where: Path) -> None:
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(state))
    unknown = sorted(set(state) - set(shapes) - {EMBEDDING})
    if missing or unknown:
        raise HstapError(f"{where}: not the drafter its config.json describes "
                         f"(missing {missing or 'none'}, unexpected {unknown or 'none'})")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise HstapError(f"{where}: {name} has shape {tuple(state[name].shape)}, config.json implies {shape}")
    if state["d2t"].dtype != torch.int64 or state["t2d"].dtype != torch.bool:
        raise HstapError(f"{where}: d2t must be int64 and t2d bool (got {state['d2t'].dtype}, {state['t2d'].dtype})")
    targets = state["d2t"] + torch.arange(cfg.draft_vocab_size)  # d2t holds offsets: target = draft + d2t[draft]
    in_range = bool(((targets >= 0) & (targets < cfg.vocab_size)).all())
    if not in_range or not bool((targets[1:] > targets[:-1]).all()) or not bool(state["t2d"][targets].all()) \
            or int(state["t2d"].sum()) != cfg.draft_vocab_size:
        raise HstapError(f"{where}: d2t/t2d do not describe one draft vocabulary of {cfg.draft_vocab_size} "
                         "distinct target ids (rebuild it with hstap.drafter.build_draft_vocab)")


def engine_layer_ids(config: dict) -> dict[str, list[int]]:
    """Canonical ids (residual stream after layer k) each engine's loader derives from an export's config.json:
    SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the stream entering layer id + 1,
    i.e. after layer id; vLLM reads the top-level key (sorted, deduplicated), its id j being the stream after
    layer j - 1."""
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = config.get("eagle_aux_hidden_state_layer_ids")
    return {"sglang": list(sglang) if isinstance(sglang, list) else [],
            "vllm": [j - 1 for j in sorted(set(vllm))] if isinstance(vllm, list) else []}


def _read(out: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    missing = [name for name in FILES if not (out / name).is_file()]
    if missing:
        raise HstapError(f"export {out}: missing {', '.join(missing)} (an export holds {', '.join(FILES)})")
    try:
        config = json.loads((out / "config.json").read_text())
        provenance = json.loads((out / "hstap.json").read_text())
    except ValueError as exc:
        raise HstapError(f"export {out}: config.json or hstap.json is not JSON ({exc})") from None
    try:
        tensors = load_file(str(out / "model.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise HstapError(f"export {out}/model.safetensors: not readable as safetensors ({exc})") from None
    return config, tensors, provenance


def problems(out: Path, cfg: DrafterConfig, state: dict[str, torch.Tensor]) -> list[str]:
    """Every way the export in `out` differs from what the drafter (`cfg`, `state`) exports to, one line each."""
    config, tensors, provenance = _read(out)
    dtype = provenance.get("dtype", "bf16")
    found = []
    for engine, ids in engine_layer_ids(config).items():
        if ids != cfg.aux_layer_ids:
            found.append(f"config.json: {engine} would feed the drafter target layers {ids} (canonical), it was "
                         f"trained on {cfg.aux_layer_ids}")
    expected = draft_config(cfg, dtype)
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is not True:
        found.append("config.json: eagle_config.use_aux_hidden_state is not true (the engine would draft from the "
                     "last hidden state only)")
    for key, value in expected.items():
        if key in ("eagle_config", "eagle_aux_hidden_state_layer_ids"):
            continue  # the layer ids, checked above as each engine reads them
        if config.get(key) != value:
            found.append(f"config.json: {key}={config.get(key)!r}, the drafter implies {value!r}")
    want = draft_tensors(cfg, state, torch_dtype(dtype), bool(provenance.get("include_embedding")))
    for name in sorted(set(want) - set(tensors)):
        found.append(f"model.safetensors: {name} missing (the engine would leave it at its initial value)")
    for name in sorted(set(tensors) - set(want)):
        found.append(f"model.safetensors: {name} is not part of this drafter")
    for name in sorted(set(want) & set(tensors)):
        got, ref = tensors[name], want[name]
        if got.dtype != ref.dtype or got.shape != ref.shape:
            found.append(f"model.safetensors: {name} is {got.dtype} {tuple(got.shape)}, expected {ref.dtype} "
                         f"{tuple(ref.shape)}")
        elif not torch.equal(got, ref):
            diff = (got.float() - ref.float()).abs().max().item() if ref.is_floating_point() else \
                int((got != ref).sum())
            what = "max |Δ|" if ref.is_floating_point() else "entries differ:"
            found.append(f"model.safetensors: {name} differs from the drafter's ({what} {diff:g})")
    for key, value in [("aux_layer_ids", cfg.aux_layer_ids), ("target_fingerprint", cfg.target_fingerprint),
                       ("target_num_layers", cfg.target_num_layers), ("draft_vocab_size", cfg.draft_vocab_size)]:
        if provenance.get(key) != value:
            found.append(f"hstap.json: {key}={provenance.get(key)!r}, the drafter has {value!r}")
    return found


def store_problems(out: Path, store: Path) -> list[str]:
    """Differences between the export in `out` and what a store (e.g. captured through the serving engine) holds:
    the layers the engine would feed the drafter must be the store's, from the same target and hidden size."""
    from hstap.store import open_store

    config, _, provenance = _read(out)
    meta = open_store(store).manifest.meta
    found = [f"config.json: {engine} would feed target layers {ids}, the store {store} holds {list(meta.layer_ids)}"
             for engine, ids in engine_layer_ids(config).items() if ids != list(meta.layer_ids)]
    if config.get("target_hidden_size") != meta.hidden_size:
        found.append(f"config.json: target_hidden_size={config.get('target_hidden_size')}, the store {store} has "
                     f"hidden_size={meta.hidden_size}")
    if provenance.get("target_fingerprint") != meta.model_fingerprint:
        found.append(f"hstap.json: target_fingerprint={provenance.get('target_fingerprint')}, the store {store} was "
                     f"captured from {meta.model_id} ({meta.model_fingerprint})")
    return found


def check_export(out: Path | str, drafter_dir: Path | str, store: Path | str | None = None) -> dict:
    """Check the export in `out` against the drafter in `drafter_dir` (and a store); HstapError on the first
    problem, with how many more there are. Returns what was checked."""
    out = Path(out)
    cfg, state = read_drafter(drafter_dir)
    found = problems(out, cfg, state) + (store_problems(out, Path(store)) if store is not None else [])
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise HstapError(f"export {out} does not match drafter {drafter_dir}: {found[0]}{more}")
    return {"layer_ids": cfg.aux_layer_ids, "tensors": len(load_file(str(out / "model.safetensors")))}
