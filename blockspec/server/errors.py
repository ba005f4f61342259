"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with a
fitting status. Rule: 400 for a body that is not JSON, text that is not UTF-8 or a value the
engine refuses (range, context length, vocabulary, too many prompts), 422 for a body whose
shape is wrong (type, unknown field, unknown role), 401 bad API key, 404 unknown model / route
/ request id, 405 method (with Allow), 413 body too large, 429 queue full, 503 shutting down,
500 engine failure. Error bodies are ASCII JSON, so no message can fail to encode."""
from __future__ import annotations

import json
import logging
from typing import get_args

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.server.protocol import TEXT_ERROR

log = logging.getLogger("blockspec")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
INTERNAL = "internal_error"      # the code of a 500 no handler foresaw


class APIError(Exception):
    """Raised anywhere in a handler; answered as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> Response:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_json(status: int, message: str, **kw: str | None) -> bytes:
    return json.dumps(error_body(status, message, **kw)).encode()


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(error_json(status, message, param=param, code=code), status_code=status,
                    media_type="application/json", headers=headers)


def _loc(loc: tuple) -> str:
    """('body', 'messages', 1, 'role') -> 'messages[1].role'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# pydantic's range errors: the body is JSON of the right shape, the value is refused (400)
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}
_LENGTHS = ("too_short", "too_long")


def _number(x: object) -> str:
    """Bounds as people write them: 2**64, 2**31 - 1; huge inputs summarised."""
    if isinstance(x, int) and not isinstance(x, bool):
        if x > 2**20 and x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
        if x > 2**20 and (x + 1) & x == 0:
            return f"2**{x.bit_length()} - 1"
        if x.bit_length() > 128:
            return f"an int of {x.bit_length()} bits"
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    if isinstance(x, float) and abs(x) > 1e15:
        return f"{x:g}"
    return repr(x) if isinstance(x, str) else str(x)


def _interval(bounds: dict) -> str:
    """{'ge': 1, 'le': 128} -> 'in [1, 128]'; {'ge': 1} -> '>= 1'."""
    lo = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    hi = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if lo and hi:
        return (f"in {'[' if lo[0] == 'ge' else '('}{_number(lo[1])}, "
                f"{_number(hi[1])}{']' if hi[0] == 'le' else ')'}")
    k, v = lo or hi
    return f"{dict(_BOUNDS.values())[k]} {_number(v)}"


def _field_range(loc: tuple, models: tuple[type, ...]) -> str | None:
    """The whole range the request models give the field at ``loc`` (its description when it
    has one, else its bounds), so an error shows both sides, not only the one crossed."""
    name = next((p for p in reversed(loc) if isinstance(p, str)), None)
    for model in models:
        info = getattr(model, "model_fields", {}).get(name)
        if info is None:
            continue
        if info.description:
            return info.description
        found: dict = {}
        _collect_bounds([*info.metadata, info.annotation], found)
        if found:
            return _interval(found)
    return None


def _collect_bounds(items: list, found: dict) -> None:
    """ge/gt/le/lt of constraint objects, also inside Annotated and unions (``X | None``)."""
    for m in items:
        for key in ("ge", "gt", "le", "lt"):
            if isinstance(getattr(m, key, None), (int, float)):
                found.setdefault(key, getattr(m, key))
        if hasattr(m, "metadata") and isinstance(m.metadata, list):
            _collect_bounds(m.metadata, found)          # a FieldInfo inside Annotated
        if hasattr(m, "__metadata__"):
            _collect_bounds(list(m.__metadata__), found)
        elif get_args(m) and not isinstance(m, type):
            _collect_bounds([a for a in get_args(m) if a is not type(None)], found)


def validation_message(errors: list[dict], models: tuple[type, ...] = ()
                       ) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic / FastAPI request validation errors: 400 for a
    body that is not JSON, text that is not UTF-8 or a value out of its range; 422 for a
    wrong shape (type, unknown field, missing field)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (e.get("ctx") or {}).get("error", "")
        return 400, f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if not errors:
        return 422, "the request body does not match the schema", None
    text = next((e for e in errors if e.get("type") == TEXT_ERROR), None)
    if text is not None:
        return 400, text["msg"], (text.get("ctx") or {}).get("param") or None
    if all(e.get("type") in _BOUNDS or e.get("type") in _LENGTHS for e in errors):
        e = errors[0]
        where = _loc(tuple(e.get("loc", ())))
        if e["type"] in _LENGTHS:
            least = (e.get("ctx") or {}).get("min_length")
            if e["type"] == "too_short" and least == 1:
                return 400, f"{where} is empty: give at least one item", where
            return 400, f"{where}: {e.get('msg', 'wrong length')}", where
        wanted = _field_range(tuple(e.get("loc", ())), models) or _interval(e.get("ctx") or {})
        return 400, f"{where} must be {wanted}, got {_number(e.get('input'))}", where
    parts = []
    for e in errors[:3]:
        where = _loc(tuple(e.get("loc", ())))
        msg = "unknown field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return 422, "; ".join(parts) + more, _loc(tuple(errors[0].get("loc", ()))) or None


def install(app: FastAPI, models: tuple[type, ...] = ()) -> None:
    """Answer every error as OpenAI's error JSON. An unexpected exception is answered 500 by
    the Guard middleware (middleware.py), not here: Starlette re-raises after a handler for
    Exception, and uvicorn then drops the keep-alive connection."""
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        status, message, param = validation_message(list(exc.errors()), models)
        return error_response(status, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no such route: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            message = "the request body could not be parsed: it is not UTF-8 JSON"
        return error_response(exc.status_code, message, headers=exc.headers)   # 405: Allow
