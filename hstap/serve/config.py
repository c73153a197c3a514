"""ServeConfig: what `hstap serve` runs and how long it waits."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from hstap.capture.config import LAYERS_HELP, VLLM_ROUTE_HELP, VllmRoute
from hstap.config import Device, StoreDtype, option
from hstap.store.config import HIDDEN_DTYPE


class ServeConfig(BaseModel):
    """Start an engine (with capture taps), wait until it is ready, watch for hangs, stop it cleanly.

    Everything after `--` goes to the engine unchanged (flags that break capture are refused)."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["sglang", "vllm", "hf"] = option(help="the engine to start")
    model: str = option(help="'smollm2' or a checkpoint directory")
    host: str = option("127.0.0.1", "address the engine listens on")
    port: int = option(8000, "port the engine listens on", gt=0, lt=65536)
    capture_layers: str | None = option(None, f"{LAYERS_HELP} (with --capture-dir)")
    capture_dir: Path | None = option(None, "store the engine's taps write (enables capture)")
    run_dir: Path = option(Path("runs/serve"), "engine.log, and stacks/ on a hang")
    ready_timeout: float = option(1800, "seconds until the engine must be ready", gt=0)
    stall_timeout: float = option(300, "seconds without log output before ready that count as a hang (half "
                                       "with a core spinning)", gt=0)
    health_timeout: float | None = option(None, "once ready, seconds without an answer from the engine's health "
                                                "endpoint that count as a hang (default: --stall-timeout)", gt=0)
    grace_s: float = option(10, "seconds between SIGTERM and SIGKILL", flag="--grace", ge=0)
    command: list[str] | None = option(None, "program to run instead of the engine's launcher (a wrapper, "
                                             "container or test double); it gets the same arguments",
                                       flag="--command", metavar="'PROGRAM ARGS'")
    vllm_route: VllmRoute = option("extension", VLLM_ROUTE_HELP + "; extract needs --capture-dir")
    engine_python: Path | None = option(None, "the Python of the engine's own virtual environment, where hstap is "
                                              "installed too (default: this one)")
    drafter: Path | None = option(None, "hf engine: decode speculatively with this drafter run directory")
    draft: str | None = option(None, "hf engine: draft shape (chain:K, tree:D,TOPK,N, ngram:K, hybrid:K[,N]; default chain:3 "
                                     "with --drafter)")
    extra: list[str] = option(default_factory=list, help="-- then engine arguments", positional=True)
    echo: bool = option(True, "echo the engine's output", cli=False)

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and " " in value[0]:
            return shlex.split(value[0])  # `--command "python fake.py --x"` arrives as one appended string
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("extra", mode="before")
    @classmethod
    def _after_dashes(cls, value):
        return value[1:] if isinstance(value, list) and value[:1] == ["--"] else value


class HfServerConfig(BaseModel):
    """hstap's own OpenAI-compatible server over a transformers target (`python -m hstap.serve.hf_capture`, what
    `hstap serve --engine hf` runs), with the capture taps when `capture_dir` is given."""

    model_config = ConfigDict(extra="forbid")

    model: str = option("smollm2", "'smollm2' (embedded) or a transformers checkpoint dir")
    name: str | None = option(None, "model id to serve as (default: the target's model id)")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", gt=0, lt=65536)
    device: Device = option("cpu", "cpu | cuda | cuda:N")
    max_batch: int = option(8, "requests decoded together", ge=1)
    capture_layers: str | None = option(None, f"{LAYERS_HELP}; 'auto' when only --capture-dir is given")
    capture_dir: Path | None = option(None, "store the taps write (omit to serve without taps)")
    dtype: StoreDtype = option(HIDDEN_DTYPE, "hidden-state storage dtype (fp8: e4m3 with a scale per token and layer)")
    drafter: Path | None = option(None, "decode speculatively with this drafter run directory (`hstap train`)")
    draft: str | None = option(None, "draft shape: chain:K, tree:D,TOPK,N, hybrid:K[,N] or ngram:K (no drafter needed); default "
                                     "chain:3 with --drafter")

    @field_validator("draft")
    @classmethod
    def _known_shape(cls, value):
        from hstap.errors import HstapError
        from hstap.runtime.shapes import DraftShape

        if value is not None:
            try:
                DraftShape.parse(value)
            except HstapError as exc:
                raise ValueError(str(exc)) from None
        return value
