"""SynthConfig: everything a synth run depends on; `hstap synth --plan` prints it resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SynthConfig(BaseModel):
    """Regenerate the assistant turns of `data` with the target: embedded (`model`) or served (`servers`).

    With `servers`, `model` is the model id the servers must report; left unset it is read from the first
    server's `/v1/models` and every server must agree.
    """

    model_config = ConfigDict(extra="forbid")

    data: str = "sharegpt"
    out: Path
    model: str | None = None
    servers: list[str] = Field(default_factory=list)
    limit: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=512, ge=1)
    turns: Literal["first", "all"] = "first"
    concurrency: int | None = Field(default=None, ge=1)
    seed: int = 0
    drop_truncated: bool = False
    # embedded backend
    device: str = "cpu"
    batch_size: int = Field(default=16, ge=1)
    cuda_graphs: bool | None = None  # None: on CUDA only
    compile_step: bool = False  # torch.compile the decode step (GPU: faster after ~1 min of compiling)
    # server backend
    timeout: float = Field(default=120.0, gt=0)
    retries: int = Field(default=3, ge=0)
    backoff: float = Field(default=0.5, ge=0)

    @model_validator(mode="after")
    def _one_backend(self) -> "SynthConfig":
        if not self.servers and not self.model:
            raise ValueError("give --model NAME (embedded) or --server URL (an OpenAI-compatible server)")
        for url in self.servers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server {url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:30000")
        if self.out.suffix != ".jsonl":
            raise ValueError(f"out {str(self.out)!r} must end in .jsonl (failures go to a .failed.jsonl beside it)")
        return self

    @property
    def backend(self) -> Literal["embedded", "server"]:
        return "server" if self.servers else "embedded"

    @property
    def in_flight(self) -> int:
        """Conversations in flight: `concurrency`, else 8 per server or two embedded batches (one queued)."""
        if self.concurrency is not None:
            return self.concurrency
        return 8 * len(self.servers) if self.servers else 2 * self.batch_size

    def sampling(self) -> dict[str, float | int]:
        """The sampling parameters recorded with every output record."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                "seed": self.seed}
