"""One error shape for the whole API: OpenAI's envelope, mapped in one place.

Our own failures raise ``APIError``; FastAPI's and Starlette's own (validation, 404, 405)
are caught by the handlers installed here so no ``{"detail": ...}`` ever leaks; anything else
ends in a 500 from ``request_scope.internal_error``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from embedserve.contracts.errors import HEAD_TOO_LARGE, error_body, head_too_large_message


class APIError(Exception):
    """An error that leaves as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def renamed(err: APIError, names: dict[str, str], params: dict[str, str]) -> APIError:
    """``err`` in another API's words: ``names`` replaced in its message, its param by ``params``."""
    message = err.message
    for ours, theirs in names.items():
        message = message.replace(ours, theirs)
    param = params.get(err.param or "", err.param)
    return APIError(err.status, message, param=param, code=err.code, headers=err.headers)


def head_too_large(max_bytes: int) -> APIError:
    """431 for a request head over the cap (the parser's backstop sends the same text)."""
    return APIError(431, head_too_large_message(max_bytes), code=HEAD_TOO_LARGE)


def error_response(err: APIError) -> Response:
    return Response(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers,
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic names union branches ("str", "list[str]", ...); they mean nothing to clients.
    parts = [p for p in parts if not any(ch in p for ch in "[]") and p not in {"str", "int"}]
    return ".".join(parts) if parts else None


def input_shapes(accept_token_ids: bool) -> str:
    """What ``input`` may be on this server: token ids only where ``gateway.accept_token_ids``."""
    if accept_token_ids:
        return "a string, a list of strings, a list of token ids or a list of token-id lists"
    return ("a string or a list of strings (this server takes no token ids: "
            "EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS is false)")


def what(value: Any) -> str:
    """A JSON value's kind, for messages: 'a number', 'an object'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "a number"
    return {str: "a string", float: "a decimal number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def input_problem(value: Any, accept_token_ids: bool) -> str | None:
    """Which element of a list ``input`` breaks its shape, e.g. ``input[1] is a number, but
    input[0] is a string``; None when the shape is not the problem."""
    if not isinstance(value, list) or not value:
        return None
    first = value[0]
    ids_ok = accept_token_ids and (_is_id(first) or isinstance(first, list))
    if not (isinstance(first, str) or ids_ok):
        return f"input[0] is {what(first)}; input must be {input_shapes(accept_token_ids)}"
    if not accept_token_ids:
        bad = next((i for i, item in enumerate(value) if not isinstance(item, str)), None)
        if bad is None:
            return None
        return (f"input[{bad}] is {what(value[bad])}, but input[0] is a string: a list input "
                f"holds only strings (this server takes no token ids)")
    for i, item in enumerate(value):
        if isinstance(first, list) and isinstance(item, list):
            bad = next((j for j, x in enumerate(item) if not _is_id(x)), None)
            if bad is not None:
                return f"input[{i}][{bad}] is {what(item[bad])}; a token-id list holds whole numbers only"
            continue
        same = isinstance(item, str) if isinstance(first, str) else _is_id(item)
        if not same:
            return (
                f"input[{i}] is {what(item)}, but input[0] is {what(first)}: a list input holds "
                "only strings, only token ids, or only token-id lists"
            )
    return None


def validation_error(
    exc: RequestValidationError | Any, body: Any = None, accept_token_ids: bool = False
) -> APIError:
    """400 naming the field (and, for ``input``, the element) that is wrong; for ``input``,
    what this server accepts (``accept_token_ids``: the gateway's setting)."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if param == "input" and first.get("type") != "missing":  # pydantic reports one union branch
        value = body.get("input") if isinstance(body, dict) else None
        problem = input_problem(value, accept_token_ids)
        if problem:
            return APIError(400, f"Invalid request: {problem}", param=param, code="invalid_value")
        msg = f"must be {input_shapes(accept_token_ids)}"
    where = f"'{param}': " if param else ""
    return APIError(400, f"Invalid request: {where}{msg}", param=param, code="invalid_value")


#: OpenAI's paths that clients reach when their base URL lacks the ``/v1``.
_OPENAI_PATHS = ("/embeddings", "/models")


def not_found_message(path: str) -> str:
    """404's text; for OpenAI's paths without ``/v1``, the URL the client meant."""
    if path.rstrip("/") in _OPENAI_PATHS or path.startswith("/models/"):
        return (
            f"Not found: {path}. The API lives under /v1 (/v1{path.rstrip('/')}): give clients "
            "a base URL that ends in /v1, e.g. http://HOST:8000/v1"
        )
    return f"Not found: {path}"


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = {404: not_found_message(request.url.path), 405: "Method not allowed"}.get(
            status, str(exc.detail)
        )
        headers = dict(exc.headers or {})
        return error_response(APIError(status, message, headers=headers))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
