"""One error shape for the whole API: OpenAI's envelope, mapped in one place.

Our own failures raise ``APIError``; FastAPI's and Starlette's own (validation, 404, 405)
are caught by the handlers installed here so no ``{"detail": ...}`` ever leaks.
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


def validation_error(exc: RequestValidationError | Any) -> APIError:
    errors = exc.errors() if hasattr(exc, "errors") else []
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if param == "input" and first.get("type") != "missing":  # pydantic reports one union branch
        msg = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
    where = f"'{param}': " if param else ""
    return APIError(400, f"Invalid request: {where}{msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        return error_response(validation_error(exc))

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = {404: "Not found", 405: "Method not allowed"}.get(status, str(exc.detail))
        headers = dict(exc.headers or {})
        return error_response(APIError(status, message, headers=headers))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        return error_response(APIError(500, "Internal error; the request id is in the logs"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
