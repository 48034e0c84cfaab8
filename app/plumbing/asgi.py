"""Connection-level helpers: bounded body reads, client-gone detection, request ids, the SSE response."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.plumbing.errors import APIError

T = TypeVar("T")
REQUEST_ID_HEADER = b"x-request-id"
# A client's id is echoed only if it is short printable ASCII: it goes back into a header and logs.
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


# What a client that disconnects is "answered" (it is never seen): nginx's "client closed request".
CLIENT_CLOSED_STATUS = 499


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body (see `bounded_body`)."""
    return b"".join([chunk async for chunk in bounded_body(request, max_bytes)])


async def bounded_body(request: Request, max_bytes: int) -> AsyncGenerator[bytes, None]:
    """The body's pieces, refused with 413 as soon as it is known to exceed max_bytes: from its
    Content-Length if it declares one, else while it streams in (chunked uploads declare none).
    A client that leaves mid-body raises ClientGone."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            yield chunk
    except ClientDisconnect:
        raise ClientGone from None


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {max_bytes} bytes.")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client goes away. Call only once the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run work while watching the connection. If the client leaves first, work is cancelled (and
    its cleanup has run) before ClientGone is raised."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work_task.cancel()  # a no-op once it is done
        # Let the cancelled work clean up (it closes the engine request) before going on.
        await asyncio.gather(work_task, watcher, return_exceptions=True)
    if work_task.cancelled():
        raise ClientGone
    return work_task.result()


class EventStreamResponse(Response):
    """An SSE response that owns its event generator: whether the stream ends, the client leaves
    or the send fails, the generator is closed here, at once, not whenever it is collected; its
    cleanup is what releases the engine request."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._send_all(send))
        except (ClientGone, OSError):
            pass  # nobody is left to tell
        finally:
            await self._events.aclose()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class RequestIdMiddleware:
    """Every response carries x-request-id: the client's own if it sent a usable one, else a new one.
    Outermost, so even the error pages of the server's last-resort handler carry it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id_of(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ShutdownAnswerMiddleware:
    """A request the server cancels at shutdown gets `answer`'s response, not uvicorn's bare 500.

    uvicorn gives running requests `timeout_graceful_shutdown` after the drain, then cancels their tasks
    and answers a 500 for any whose response had not begun. Those are requests still waiting before the
    engine (for a tenant's turn at the worker threads, say): the drain ends everything in the engine
    with its own error. While `is_shutting_down()`, such a cancellation is answered instead (a 503 in the
    API's own shape) and the task ends quietly; at any other time it is passed on unchanged."""

    def __init__(self, app: ASGIApp, is_shutting_down: Callable[[], bool],
                 answer: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self.is_shutting_down = is_shutting_down
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal has_started
            has_started = has_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except asyncio.CancelledError:
            if has_started or not self.is_shutting_down():
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # answered: the cancellation has done what it was for
            response = await self.answer(Request(scope))
            await response(scope, receive, send)


def _request_id_of(scope: Scope) -> bytes:
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER and _VALID_REQUEST_ID.fullmatch(value.decode("latin-1")):
            return bytes(value)
    return uuid.uuid4().hex.encode()
