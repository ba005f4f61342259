"""One pure ASGI middleware in front of every route: API key (401), body size (413), the
per-route request counter, and the answer to an exception no handler caught (500). Pure ASGI
rather than ``BaseHTTPMiddleware``, which would buffer streaming responses and hide client
disconnects from them. It runs before the body is parsed, so a wrong key is answered 401 even
when the body is also malformed.

The 500 is answered here rather than by an exception handler for ``Exception``: Starlette runs
that one in its outermost middleware and re-raises after it, and uvicorn then closes the
connection, so the client's next request on a keep-alive connection would fail too. Here the
exception ends with the response, and the connection lives on."""
from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from blockspec.server.errors import INTERNAL, error_json
from blockspec.server.metrics import Metrics

log = logging.getLogger("blockspec")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})     # answered without the API key


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics, routes: frozenset[str]) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.metrics, self.routes = metrics, routes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        started = [False]
        answered = [False]      # we replied ourselves (413 mid-body): drop the app's reply

        async def send_counted(message: Message) -> None:
            if answered[0]:
                return
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                started[0] = True
            await send(message)

        try:
            rejected = self._reject(scope)
            if rejected is not None:
                await _reply(send_counted, *rejected)
                return
            await self.app(scope, self._limited(receive, send_counted, answered), send_counted)
        except Exception as e:      # noqa: BLE001 - answered, never re-raised (see above)
            log.exception("unhandled error in a request handler")
            if not started[0] and not answered[0]:
                status[0] = 500
                with contextlib.suppress(Exception):        # the client may be gone already
                    await _reply(send_counted, 500, error_json(
                        500, f"internal error: {type(e).__name__}: {e}", code=INTERNAL))
            # else a response is under way and cannot become an error; it ends unfinished
        finally:
            path = scope["path"]
            self.metrics.http.labels(route=path if path in self.routes else "other",
                                     status=str(status[0])).inc()

    def _reject(self, scope: Scope) -> tuple[int, bytes] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not token:
                return 401, error_json(401, "missing API key: send 'Authorization: Bearer KEY'",
                                       code="invalid_api_key")
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                return 401, error_json(401, "incorrect API key", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return 413, error_json(413, f"request body of {length} bytes is larger than the "
                                        f"limit of {self.max_body} bytes", code="request_too_large")
        return None

    def _limited(self, receive: Callable, send: Callable, answered: list[bool]) -> Callable:
        """A receive that answers 413 itself once a body without Content-Length grows past the
        limit, and tells the app the client has gone."""
        seen = [0]

        async def receive_limited() -> Message:
            if answered[0]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    await _reply(send, 413, error_json(
                        413, f"request body is larger than the limit of {self.max_body} bytes",
                        code="request_too_large"))
                    answered[0] = True
                    return {"type": "http.disconnect"}
            return message
        return receive_limited


async def _reply(send: Callable, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
