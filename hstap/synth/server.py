"""The server backend: any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, `hstap.serve.hf_server`).

    async with ServerBackend(["http://127.0.0.1:30000"], model=None, timeout=120, retries=3, backoff=0.5,
                             max_connections=8, seed=0) as backend:
        completion = await backend.complete(messages, TurnSampling(512, 0.0, 1.0, seed=7))

Requests go round-robin over the servers; a retry goes to the next one. Connection errors, timeouts, 429 and
5xx answers are retried with exponential backoff (with jitter); other 4xx answers fail the request at once, and
400/413/422 (the request itself is refused, e.g. longer than the model's context) as a permanent failure.
On entry every server's `/v1/models` must list the expected model (by default the first server's first
model), and every answer must name it: a server serving another model stops the run with a one-line error.
"""

from __future__ import annotations

import asyncio
import random
import time
from types import TracebackType

import httpx

from hstap.errors import HstapError
from hstap.synth.backend import Completion, PermanentFailure, RequestFailed, TurnSampling

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REJECTED_STATUS = frozenset({400, 413, 422})  # this very request is malformed or too long: it will fail again


class ModelMismatch(HstapError):
    """A server serves (or answers with) another model than the run's: fatal, the records would be mixed."""


def base_url(url: str) -> str:
    """`http://h:p/`, `http://h:p/v1` -> `http://h:p`."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def models_failed(url: str, exc: BaseException) -> HstapError:
    """The one line for a `GET /v1/models` that got no answer: what `ServerBackend` and `probe_server` both say."""
    return HstapError(f"server {url}: GET /v1/models failed ({type(exc).__name__}: {exc}); is it up?")


def probe_server(url: str, timeout: float, retries: int, backoff: float) -> list[str]:
    """`ServerBackend`'s check on entry (`GET /v1/models`), for a synchronous client (capture-remote), bounded by
    `timeout` seconds in all: a server that accepts connections and never answers is named then, instead of after
    every request's own read timeout. Connection errors (nothing listening yet, a reset) are tried `retries` times
    with backoff; a read timeout is not (the server took the request and sat on it).

    Returns the model ids listed, or [] when the server answers with anything else (a 404 from an engine without
    the route: it is up, which is what a caller naming no model needs). Raises HstapError naming the URL."""
    url = base_url(url)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    for attempt in range(max(retries, 1)):
        if attempt:
            time.sleep(max(0.0, min(backoff * 2 ** (attempt - 1), deadline - time.monotonic())))
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            resp = httpx.get(f"{url}/v1/models", timeout=httpx.Timeout(left, connect=min(left, 10.0)))
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:  # not taken: try again
            last = exc
            continue
        except httpx.TimeoutException:
            raise HstapError(f"server {url} accepted the connection but did not answer GET /v1/models within "
                             f"{timeout:g} s: is it hung, or still loading? (raise --timeout to wait longer)") from None
        except httpx.HTTPError as exc:
            raise models_failed(url, exc) from None
        try:
            return [m["id"] for m in resp.json()["data"]] if resp.status_code == 200 else []
        except (ValueError, KeyError, TypeError):
            return []
    if last is None:
        raise HstapError(f"server {url}: no answer to GET /v1/models within {timeout:g} s")
    raise HstapError(f"server {url}: GET /v1/models failed ({type(last).__name__}: {' '.join(str(last).split())}, "
                     f"{attempt + 1} attempts); is it up?")


class ServerBackend:
    """Bounded-concurrency async client over one or more OpenAI-compatible servers."""

    def __init__(self, urls: list[str], *, model: str | None, timeout: float, retries: int, backoff: float,
                 max_connections: int, seed: int, transport: httpx.AsyncBaseTransport | None = None):
        """Settings as `hstap synth` gives them (hstap.synth.config.SynthConfig holds their defaults);
        `transport`: the tests' httpx.MockTransport."""
        if not urls:
            raise HstapError("no --server given")
        self.urls = [base_url(u) for u in urls]
        self.model_id = model or ""
        self.retries, self.backoff, self.timeout = retries, backoff, timeout
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._next = 0
        self._jitter = random.Random(seed)
        self._transport = transport  # tests inject httpx.MockTransport here
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "ServerBackend":
        self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits, transport=self._transport)
        try:
            await self._check_models()
        except BaseException:
            await self._client.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _check_models(self) -> None:
        for url in self.urls:
            served = await self._served_models(url)
            if not self.model_id:
                self.model_id = served[0]
            if self.model_id not in served:
                raise ModelMismatch(f"server {url} serves {', '.join(map(repr, served))}, not {self.model_id!r}: "
                                    f"point --server at servers of one model, or pass --model {served[0]}")

    async def _served_models(self, url: str) -> list[str]:
        try:
            resp = await self._client.get(f"{url}/v1/models")
            resp.raise_for_status()
            ids = [m["id"] for m in resp.json()["data"]]
        except httpx.HTTPError as exc:
            raise models_failed(url, exc) from None
        except (ValueError, KeyError, TypeError):
            raise HstapError(f"server {url}: /v1/models is not an OpenAI model list") from None
        if not ids:
            raise HstapError(f"server {url}: /v1/models lists no model")
        return ids

    async def complete(self, messages: list[dict[str, str]], sampling: TurnSampling) -> Completion:
        """POST one chat completion, retrying transient failures; raises RequestFailed or ModelMismatch."""
        body = {"model": self.model_id, "messages": messages, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1) * (0.5 + self._jitter.random()))
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            try:  # httpx times each read; wait_for bounds the whole request
                resp = await asyncio.wait_for(self._client.post(f"{url}/v1/chat/completions", json=body),
                                              self.timeout)
            except (httpx.TransportError, TimeoutError) as exc:  # refused, reset, timed out: try the next server
                last = f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")
                continue
            if resp.status_code in RETRY_STATUS:
                last = f"{url}: HTTP {resp.status_code} {resp.text[:200]}"
                continue
            if resp.status_code in REJECTED_STATUS:
                raise PermanentFailure(f"{url}: HTTP {resp.status_code} {resp.text[:200]}", "rejected_by_server")
            if resp.status_code != 200:
                raise RequestFailed(f"{url}: HTTP {resp.status_code} {resp.text[:200]}")
            return self._parse(url, resp)
        raise RequestFailed(f"gave up after {self.retries + 1} attempts; last: {last}")

    def _parse(self, url: str, resp: httpx.Response) -> Completion:
        try:
            data = resp.json()
            choice = data["choices"][0]
            content, finish, model = choice["message"]["content"], choice["finish_reason"], data["model"]
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestFailed(f"{url}: not an OpenAI chat completion: {resp.text[:200]}") from None
        if model != self.model_id:
            raise ModelMismatch(f"server {url} answered with model {model!r}, expected {self.model_id!r}: "
                                f"every --server must serve the same model")
        if not isinstance(content, str):
            raise RequestFailed(f"{url}: answer content is {type(content).__name__}, expected a string")
        return Completion(content=content, finish_reason=str(finish), prompt_tokens=int(usage.get("prompt_tokens", 0)),
                          completion_tokens=int(usage.get("completion_tokens", 0)))
