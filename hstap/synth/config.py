"""SynthConfig: everything a synth run depends on; `hstap synth --plan` prints it resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from hstap.config import Device, option


class SynthConfig(BaseModel):
    """Regenerate the assistant turns of `data` with the target: embedded (`model`) or served (`servers`).

    With `servers`, `model` is the model id the servers must report; left unset it is read from the first
    server's `/v1/models` and every server must agree.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = option(None, "embedded: 'smollm2' or a checkpoint dir; with --server: the model id the "
                                     "servers must serve")
    servers: list[str] = option(default_factory=list, help="an OpenAI-compatible server (repeat for round-robin "
                                                           "over several)", flag="--server", metavar="URL")
    data: str = option("sharegpt", "sharegpt | sharegpt-all (continuation chunks recovered too) | mt-bench | "
                                   "jsonl:PATH")
    out: Path = option(help="output FILE.jsonl (re-run to resume)")
    limit: int | None = option(None, "use the first N usable conversations", ge=1)
    temperature: float = option(0.0, "0 = greedy", ge=0.0, le=2.0)
    top_p: float = option(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    max_new_tokens: int = option(512, "longest answer, per turn", ge=1)
    turns: Literal["first", "all"] = option("first", "answer the first user turn or all of them")
    concurrency: int | None = option(None, "conversations in flight (default: 8 per server, or two embedded "
                                           "batches)", ge=1)
    seed: int = option(0, "sampling seed (per conversation and turn)")
    drop_truncated: bool = option(False, "drop answers cut at --max-new-tokens")
    device: Device = option("cpu", "embedded: cpu | cuda | cuda:N")
    batch_size: int = option(16, "embedded: rows per decode batch", ge=1)
    cuda_graphs: bool | None = option(None, "embedded: replay the decode step as a CUDA graph (default: on CUDA)")
    continuous: bool | None = option(None, "embedded: refill rows as answers end (continuous batching); "
                                           "default: on a CPU, off on CUDA (static batches measured faster)")
    compile_step: bool = option(False, "embedded on a GPU: torch.compile the decode step (faster; ~1 min of "
                                       "compiling per batch size and cache-length bucket)")
    timeout: float = option(120.0, "server: seconds per request", gt=0)
    retries: int = option(3, "server: retries on 5xx, 429, timeouts, connection errors", ge=0)
    backoff: float = option(0.5, "server: first retry delay in seconds (doubles each retry)", ge=0)

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
