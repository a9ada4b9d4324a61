"""The OpenAI error envelope, ``{"error": {"message", "type", "param", "code"}}``: one
shape for every error any of our HTTP servers sends."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    err = {"message": message, "type": error_type(status), "param": param, "code": code}
    return orjson.dumps({"error": err})


HEAD_TOO_LARGE = "request_header_fields_too_large"  # the 431's code


def head_too_large_message(max_bytes: int) -> str:
    """The 431 text: one for the exact middleware check and the HTTP parser's backstop."""
    return f"Request headers and URL exceed the limit of {max_bytes} bytes"


REQUEST_TIMEOUT = "request_timeout"  # the 408's code: a request head or body that stalled


def request_timeout_message(part: str, seconds: float) -> str:
    """The 408 text for a client too slow to send its request ``part`` (head or body)."""
    return f"The request {part} did not arrive in time (limit {seconds:g} s); the connection is closed"
