"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with a
fitting status. Rule: 400 for a body that is not JSON or a value the engine refuses (range,
context length, vocabulary), 422 for a body whose shape is wrong (type, unknown field, unknown
role), 401 bad API key, 404 unknown model / route / request id, 413 body too large, 429 queue
full, 503 shutting down, 500 engine failure."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("blockspec")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raised anywhere in a handler; answered as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_json(status: int, message: str, **kw: str | None) -> bytes:
    return json.dumps(error_body(status, message, **kw)).encode()


def _loc(loc: tuple) -> str:
    """('body', 'messages', 1, 'role') -> 'messages[1].role'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(errors: list[dict]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic / FastAPI request validation errors."""
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (e.get("ctx") or {}).get("error", "")
        return 400, f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if not errors:
        return 422, "the request body does not match the schema", None
    parts = []
    for e in errors[:3]:
        where = _loc(tuple(e.get("loc", ())))
        msg = "unknown field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return 422, "; ".join(parts) + more, _loc(tuple(errors[0].get("loc", ()))) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(status, message, param=param), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such route: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"),
                            status_code=500)
