"""Bounds on what one client can make the server wait for, before any API key is checked.

- A request head must arrive whole within `http_header_timeout_s` (slowloris). uvicorn bounds only
  the idle time between requests (`timeout_keep_alive`), and any byte cancels that bound, so a
  client that sends half a head and stops would hold its connection forever.
- A request body must keep moving: each wait for its next piece is bounded by `http_body_timeout_s`,
  then the client gets a 408 in OpenAI's shape and the connection is closed.

The open-connection cap is uvicorn's own `limit_concurrency` (see `uvicorn_limit_concurrency`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.plumbing.errors import INVALID_REQUEST, APIError, error_body

REQUEST_TIMEOUT_CODE = "request_timeout"


def uvicorn_limit_concurrency(max_connections: int) -> int:
    """uvicorn's `limit_concurrency` that lets exactly `max_connections` connections be served.

    uvicorn answers 503 once `len(connections) >= limit` when a request head completes, and that set
    already holds the asking connection; so a limit of N serves N - 1. Its other count, running
    request tasks, is at most one per other connection at that moment, so it never binds first."""
    return max_connections + 1


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (the one it picks by itself, httptools being a dependency)
    with a deadline on each request head; pass it as `uvicorn.Config(http=...)`."""

    class BoundHeaderTimeoutProtocol(HeaderTimeoutProtocol):
        header_timeout_s = timeout_s
        timeout_response = _timeout_response(f"The request head did not arrive whole within {timeout_s:g} s.")

    return BoundHeaderTimeoutProtocol


def connection_capped_protocol(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """The header-timeout protocol that also enforces uvicorn's `limit_concurrency` by itself, for a
    uvicorn whose Config this code does not build (Ray Serve's proxy): each connection carries the cap
    uvicorn would have read from its Config, and uvicorn's own check answers 503 past it."""
    limit = uvicorn_limit_concurrency(max_connections)

    class ConnectionCappedProtocol(header_timeout_protocol(header_timeout_s)):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limit_concurrency = limit

    return ConnectionCappedProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """Closes a connection whose request head is not complete `header_timeout_s` after the server
    began waiting for it: from `connection_made`, and on a kept-alive connection from the end of the
    previous response. The deadline is not pushed back by bytes that trickle in.

    Relies on these uvicorn internals (uvicorn is pinned to 0.54.x in pyproject):
    - `connection_made`, `connection_lost`, `on_headers_complete` (the httptools parser callback
      once a head is whole) and `on_response_complete` (each response's end) are the hooks;
    - `on_response_complete` arms `timeout_keep_alive_task` exactly when it starts waiting for the
      next request (no pipelined one queued, connection not closing): the deadline is armed then too;
    - `self.loop` and `self.transport`, set up by uvicorn before these hooks run.
    """

    header_timeout_s: float = 10.0  # set per server by header_timeout_protocol
    timeout_response: bytes = b""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Arming from the end of the response, not from the next request's first byte, also bounds
        # a client that keeps the connection with bare CRLFs (they start no request) or with the
        # tail of a body the server already answered: either kind of byte cancels the keep-alive.
        if self.timeout_keep_alive_task is not None:
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        # The timer only runs while no request is in progress here, so no response has begun.
        self.transport.write(self.timeout_response)
        self.transport.close()


def _timeout_response(message: str) -> bytes:
    body = orjson.dumps(error_body(message, INVALID_REQUEST, code=REQUEST_TIMEOUT_CODE))
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return head + body


class BodyTimeoutMiddleware:
    """Bounds each wait for the next piece of a request body by `timeout_s`. On expiry the wait
    raises a 408 APIError, which the app's error handler answers in OpenAI's shape, with
    `connection: close`: the rest of the body may still come, so the connection cannot be reused.

    Every body reader (`read_body`, hence every JSON endpoint and the Batch file upload) goes
    through `receive`, so one wrapper covers them all and counts only time spent waiting on the
    client, never time the handler spends elsewhere."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, bounded_body_receive(receive, self.timeout_s), send)


def bounded_body_receive(receive: Receive, timeout_s: float) -> Receive:
    """receive, with each wait bounded by timeout_s until the body is complete. After that the
    only message left is the disconnect, which streaming responses await for as long as they run."""
    is_body_complete = False

    async def receive_bounded() -> Message:
        nonlocal is_body_complete
        if is_body_complete:
            return await receive()
        try:
            async with asyncio.timeout(timeout_s):
                message = await receive()
        except TimeoutError:
            raise body_timeout_error(timeout_s) from None
        is_body_complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return receive_bounded


def body_timeout_error(timeout_s: float) -> APIError:
    return APIError(408, f"The request body stopped arriving: nothing came for {timeout_s:g} s.",
                    type=INVALID_REQUEST, code=REQUEST_TIMEOUT_CODE, headers={"connection": "close"})
