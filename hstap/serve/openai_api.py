"""OpenAI's request and error shapes for the `hf` server: what `openai.OpenAI(base_url=...)` sends and can parse.

    install_error_handlers(app)            # every error as {"error": {"message", "type", "param", "code"}}
    raise ApiError(404, "model 'x' is not served here", param="model", code="model_not_found")
    refuse_unsupported(req)                # n > 1, logprobs, penalties...: 400 naming the field, not ignored

The client libraries turn that body into their exceptions (`openai.BadRequestError: Error code: 400 - <message>`,
`.param`, `.code`), so a message names the field and what it expects, on one line. FastAPI's own 422 (a pydantic
error list) becomes a 400 `invalid_request_error` naming the first bad field.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

MAX_STOPS = 4  # OpenAI's limit on `stop` sequences


class ApiError(Exception):
    """An error answered in OpenAI's shape with `status`; raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def _where(loc: tuple) -> str | None:
    """A pydantic location as OpenAI names a parameter: ("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p != "body"]
    name = ""
    for p in parts:
        name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else str(p))
    return name or None


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's pydantic errors as one 400: the first bad field, what it expects, and what it got."""
    first = exc.errors()[0]
    param = _where(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") != "missing" and "input" in first:
        message += f" (got {first['input']!r:.80})"
    more = len(exc.errors()) - 1
    return ApiError(400, f"{param or 'request body'}: {message}" + (f" (and {more} more)" if more else ""), param,
                    first.get("type"))


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, unknown routes, ApiError and unexpected failures in OpenAI's error shape."""

    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"the server failed: {type(exc).__name__}: {exc}", code="server_error").response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class OpenAIParams(BaseModel):
    """Fields OpenAI's chat and completions requests share; unknown fields are ignored, as OpenAI's are."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: list[str] | None = None
    # accepted only at their defaults (refuse_unsupported): silently ignoring them would give a wrong answer
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if value is not None and (not isinstance(value, list) or len(value) > MAX_STOPS
                                  or not all(isinstance(s, str) and s for s in value)):
            raise ValueError(f"expected a non-empty string or a list of up to {MAX_STOPS} non-empty strings")
        return value


class ChatRequest(OpenAIParams):
    """The part of OpenAI's chat request this server honours (`max_completion_tokens` is `max_tokens`' newer
    name)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict] | None = None
    response_format: dict | None = None


# field -> (the values that mean "not used", what this server does instead)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "it returns one choice per request; leave n at 1"),
    "logprobs": ((None, False), "it returns no log probabilities; leave logprobs unset or false"),
    "top_logprobs": ((None, 0), "it returns no log probabilities; leave top_logprobs unset"),
    "presence_penalty": ((None, 0), "it applies no penalties; leave presence_penalty at 0"),
    "frequency_penalty": ((None, 0), "it applies no penalties; leave frequency_penalty at 0"),
    "logit_bias": ((None, {}), "it applies no logit bias; leave logit_bias unset"),
    "tools": ((None, []), "it calls no tools; send no tools"),
    "response_format": ((None, {"type": "text"}), "it writes plain text; leave response_format unset"),
}


def refuse_unsupported(req: OpenAIParams) -> None:
    """Raise a 400 naming the first field set to something this server does not do, and the stream options of a
    request that does not stream."""
    for name, (unused, instead) in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value not in unused:
            raise ApiError(400, f"{name}={value!r} is not supported by this server: {instead}", name,
                           "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")


def max_new_tokens(req: OpenAIParams, default: int) -> int:
    """`max_completion_tokens` or its older name `max_tokens` (400 when both are given and differ)."""
    newer = getattr(req, "max_completion_tokens", None)
    if newer is not None and req.max_tokens is not None and newer != req.max_tokens:
        raise ApiError(400, f"max_tokens={req.max_tokens} and max_completion_tokens={newer} disagree: send one of "
                            "them", "max_completion_tokens")
    return newer or req.max_tokens or default
