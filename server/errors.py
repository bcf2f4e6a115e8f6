"""APIError -> HTTP error responses in each route family's shape (api.md §0.1). Import these:

    openai_error_response(err)                 JSONResponse {"error": {message, type, param, code}}
    anthropic_error_response(err, request_id)  JSONResponse {"type": "error", "error": {type, message}, "request_id"}
    openai_error_body(err) / anthropic_error_body(err)   the dicts alone, for in-band stream errors
    error_headers(err)                         retry-after, retry-after-ms, x-should-retry
    family(path)                               "anthropic" for /v1/messages*, else "openai"
    error_response(err, path, request_id)      the family's response for a request path

APIError.kind picks the error type and default code; APIError.code, when set, overrides the code
(OpenAI routes only; Anthropic errors carry no code). Anthropic answers `overloaded` with its own 529.
Both SDKs retry 408/409/429/>=500 and obey `x-should-retry`; `internal` errors default to
`x-should-retry: false` because a bug repeats on retry.
"""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from server.service import APIError

# kind -> (OpenAI type, OpenAI default code, Anthropic type)
_KINDS: dict[str, tuple[str, str | None, str]] = {
    "invalid_request": ("invalid_request_error", None, "invalid_request_error"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded", "invalid_request_error"),
    "not_found": ("invalid_request_error", "not_found", "not_found_error"),
    "method_not_allowed": ("invalid_request_error", "method_not_allowed", "invalid_request_error"),
    "authentication": ("invalid_request_error", "invalid_api_key", "authentication_error"),
    "too_large": ("invalid_request_error", "request_too_large", "request_too_large"),
    "rate_limited": ("rate_limit_error", "rate_limit_exceeded", "rate_limit_error"),
    "overloaded": ("server_error", "server_overloaded", "overloaded_error"),
    "unavailable": ("server_error", "unavailable", "api_error"),
    "timeout": ("timeout_error", "timeout", "timeout_error"),
    "internal": ("server_error", "internal_error", "api_error"),
}


def _kind(err: APIError) -> tuple[str, str | None, str]:
    return _KINDS.get(err.kind, _KINDS["internal"])


def openai_error_body(err: APIError) -> dict:
    otype, code, _ = _kind(err)
    return {"error": {"message": err.message, "type": otype, "param": err.param,
                      "code": getattr(err, "code", None) or code}}


def anthropic_error_body(err: APIError, request_id: str | None = None) -> dict:
    body = {"type": "error", "error": {"type": _kind(err)[2], "message": err.message}}
    if request_id:
        body["request_id"] = request_id
    return body


def anthropic_status(err: APIError) -> int:
    """Anthropic's status for an error: 529 for overload, else the error's own."""
    return 529 if err.kind == "overloaded" else err.status


def error_headers(err: APIError) -> dict[str, str]:
    headers = dict(getattr(err, "headers", None) or {})
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(0, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(max(0, int(err.retry_after_s * 1000)))
    should_retry = err.should_retry
    if should_retry is None and err.kind == "internal":
        should_retry = False
    if should_retry is not None:
        headers["x-should-retry"] = "true" if should_retry else "false"
    return headers


def openai_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(openai_error_body(err), status_code=err.status, headers=error_headers(err))


def anthropic_error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err, request_id), status_code=anthropic_status(err),
                        headers=error_headers(err))


def family(path: str) -> str:
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") else "openai"


def error_response(err: APIError, path: str, request_id: str | None = None) -> JSONResponse:
    if family(path) == "anthropic":
        return anthropic_error_response(err, request_id)
    return openai_error_response(err)
