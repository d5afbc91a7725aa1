"""Errors in the shape OpenAI's clients parse: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise `APIError`; one error handler in server.py turns it (and Quart's own HTTP
errors such as 404/405/413) into this shape, so every refusal a client can see reads the
same. A 429 carries two headers: ``retry-after-ms`` (milliseconds, what the issue asks for
and what the openai client reads first) and ``Retry-After`` (whole seconds, rounded up, for
everything else).
"""

from __future__ import annotations

import math

import msgspec

# Messages and `param` quote the request (a parameter's name, a model name, a bad value):
# cut, so that a 10 MB field is not echoed back whole (or twice).
MAX_MESSAGE_CHARS = 2048
MAX_PARAM_CHARS = 256


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class APIError(Exception):
    """A refusal with an HTTP status; `type` follows OpenAI's names."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _clip(message, MAX_MESSAGE_CHARS)
        param = None if param is None else _clip(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorBody(self.detail))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def rate_limited(message: str, retry_after_s: float, code: str) -> APIError:
    retry_after_s = max(0.0, retry_after_s)
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code=code,
        headers={
            "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
            "Retry-After": str(max(1, math.ceil(retry_after_s))),
        },
    )


# Retry-After of a 503: a draining server's clients should go elsewhere at once (a load
# balancer has another replica); a loading one is ready in seconds.
DRAINING_RETRY_S = 1.0
LOADING_RETRY_S = 5.0


def unavailable(message: str, code: str, retry_after_s: float | None = None) -> APIError:
    headers = {}
    if retry_after_s is not None:
        headers = {"retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
                   "Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return APIError(503, message, type="server_error", code=code, headers=headers)


# What Quart/werkzeug's HTTP errors become (the `type` OpenAI uses for each).
HTTP_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type_for(status: int) -> str:
    return HTTP_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
