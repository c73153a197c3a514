"""The capture commands' configs: `hstap capture` (embedded) and `hstap capture-remote` (a served engine).

Light on purpose (no torch): `hstap --help` and `--plan` build from these alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from hstap.config import LOOPS_HELP, Device, Dtype, Loops, StoreDtype, TeacherSpec, option, parse_duration
from hstap.store.config import HIDDEN_DTYPE, SHARD_MB

LAYERS_HELP = "'auto' = [1, L//2-1, L-4], or canonical ids like 1,14,26"
VllmRoute = Literal["extension", "extract"]
# extract: vLLM's extract_hidden_states method writes a file per request, which capture-remote turns into the store
VLLM_ROUTE_HELP = ("vLLM route: extension (hstap's hooks, needs --enforce-eager) or extract (extract_hidden_states, "
                   "keeps CUDA graphs)")
DTYPE_HELP = "hidden-state storage dtype; fp8 = e4m3 with a scale per token and layer (about half of bf16's bytes)"
MAX_TOKENS = 2048  # longest sample, in tokens: `hstap capture` and `hstap capture-remote` render alike
# The store an engine's taps write (`hstap sglang-flags`/`vllm-flags`, `hstap serve --capture-dir`): the defaults of
# hstap.capture.engine_session.EngineCaptureConfig, which `serve` builds without these flags.
ENGINE_SHARD_MB = 64
ENGINE_FLUSH_S = 1.0


def layers_text(value):
    """`[1, 14, 26]` (as `--plan` prints it) → `1,14,26`; text passes through."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(int(k)) for k in value)
    return value


class CaptureConfig(BaseModel):
    """Prefill conversations through the embedded target with the tap on, into a store; `--plan` prints it."""

    model_config = ConfigDict(extra="forbid")

    model: str = option("smollm2", "'smollm2' (embedded) or a transformers checkpoint dir")
    data: str = option("sharegpt", "sharegpt | sharegpt-all (continuation chunks recovered too) | mt-bench | "
                                   "jsonl:PATH")
    limit: int | None = option(None, "use the first N usable conversations", ge=1)
    out: Path = option(help="store directory (re-run to resume)")
    layers: str = option("auto", LAYERS_HELP)
    dtype: StoreDtype = option(HIDDEN_DTYPE, DTYPE_HELP)
    target_dtype: Dtype | None = option(None, "what the target computes in (default: fp32 on CPU, bf16 on CUDA; fp32 "
                                              "on CUDA: a reference for `hstap compare --reference`)")
    teacher: TeacherSpec = option(TeacherSpec(), "topk:K (the target's top-k log-probs) or hidden (final norm)",
                                  metavar="topk:K|hidden")
    batch_tokens: int = option(4096, "padded tokens per prefill forward", gt=0)
    max_tokens: int = option(MAX_TOKENS, "longest sample, in tokens", gt=0)
    overlong: Literal["truncate", "skip"] = option("truncate", "what to do with samples past --max-tokens")
    loops: Loops = option("keep", LOOPS_HELP)
    device: Device = option("cpu", "cpu | cuda | cuda:N")
    shard_mb: float = option(SHARD_MB, "target shard size in MiB", gt=0)
    commit_every: float = option(60.0, "commit buffered samples as a shard at least this often (90s, 5m): a kill "
                                       "loses at most this much work", metavar="DURATION", gt=0)
    force: bool = option(False, "capture even when free disk space looks short")
    repair: bool = option(False, "resume a store with damaged shards: set them aside (*.damaged) and capture "
                                 "their samples again")

    _layers_text = field_validator("layers", mode="before")(layers_text)
    _duration = field_validator("commit_every", mode="before")(parse_duration)

    def resolved(self) -> dict:
        """The config with `layers` resolved against the model's config.json (no weights loaded)."""
        from hstap.capture.layers import parse_layers
        from hstap.models.target import model_config

        out = self.model_dump(mode="json")
        out["layers"] = parse_layers(self.layers, int(model_config(self.model)["num_hidden_layers"]))
        out["teacher"] = str(self.teacher)
        return out


class RemoteCaptureConfig(BaseModel):
    """Send conversations to a served engine whose taps write `capture_dir`; wait until every sample is stored."""

    model_config = ConfigDict(extra="forbid")

    url: str = option(help="the server, e.g. http://127.0.0.1:30000")
    data: str = option(help="jsonl:PATH (e.g. hstap synth's output), sharegpt or mt-bench")
    capture_dir: Path = option(help="the directory the server's taps write")
    model: str = option("smollm2", "tokenizer: 'smollm2' or the served checkpoint dir")
    served_model: str | None = option(None, "the `model` field to send (default: none)")
    max_tokens: int = option(MAX_TOKENS, "longest sample, as for hstap capture", gt=0)
    loops: Loops = option("keep", f"{LOOPS_HELP}, as for hstap capture")
    limit: int | None = option(None, "use the first N usable conversations", ge=1)
    concurrency: int = option(4, "requests in flight", ge=1)
    retries: int = option(3, "attempts per request the server did not take (connection refused or reset, connect "
                             "timeout, HTTP 502/503/504), with backoff", ge=1)
    timeout: float = option(600.0, "seconds for the whole run", gt=0)
    settle: float = option(30.0, "after the last answer, give up waiting for the store after this long without a "
                                 "new sample", gt=0)
    vllm_route: VllmRoute = option("extension", VLLM_ROUTE_HELP)


class EngineFlagsConfig(BaseModel):
    """What an in-engine capture needs to know (`hstap sglang-flags`, `hstap vllm-flags`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = option(help="'smollm2' or the served checkpoint directory (its config.json is read)")
    layers: str = option("auto", LAYERS_HELP)
    out: Path = option(help="capture directory (the store the engine writes)")
    dtype: StoreDtype = option(HIDDEN_DTYPE, DTYPE_HELP)
    shard_mb: float = option(ENGINE_SHARD_MB, "shard size in MiB", gt=0)
    flush_s: float = option(ENGINE_FLUSH_S, "commit buffered samples after this long idle", gt=0)

    _layers_text = field_validator("layers", mode="before")(layers_text)


class SglangFlagsConfig(EngineFlagsConfig):
    """Print SGLang's `--forward-hooks` JSON and the other launch flags a capture needs."""

    as_json: bool = option(False, "print only the --forward-hooks JSON", flag="--json")
    sglang_version: str | None = option(None, "the SGLang release that will load the hooks, which decides the "
                                              "modules hooked (0.5.20, 0.5.22, 0.5.23; default 0.5.23)")


class VllmFlagsConfig(EngineFlagsConfig):
    """Print vLLM's launch flags and the `POST /collective_rpc` body that starts the taps.

    With `--vllm-route extract` it also writes OUT/vllm-extract.json, which `hstap capture-remote` reads."""

    rpc: bool = option(False, "print only the POST /collective_rpc JSON body")
    vllm_route: VllmRoute = option("extension", VLLM_ROUTE_HELP + "; extract writes OUT/vllm-extract.json")
