"""Background responses: stored `queued` at once, generated in the batch class by a task of their
own, `in_progress` from their first token, polled with GET and cancelled by id.

Every status change goes through the store's `move`, which changes only an active response: a cancel
and the end of a generation never overwrite each other, whichever is written first. Like Batch API
items, a background response survives a restart: one a stopped (or killed) server left active is
started again from its stored request and conversation when the next server starts; while the engine
or the tenant's quota turns it away, it stays queued and is tried again.

One created with `stream: true` also writes its events into a log (app/responses/replay.py) that its
client follows and that a client of the same tenant can re-attach to (GET ?stream=true); leaving the
stream does not stop the generation, only a cancel does. Its last events are published once the final
response is stored, so that a reader who has seen the end finds it stored. One that runs again after a
restart streams anew: its events are numbered from 0 again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.batch.uploads import storage_errors
from app.plumbing.errors import APIError
from app.responses.events import ResponseEvents, rebuilt_events
from app.responses.objects import ResponseHead, failed
from app.responses.replay import EventLog, EventLogs
from app.responses.runs import ResponseRun, ResponseRunner
from app.responses.schemas import ResponsesBody
from app.responses.store import ResponseStore, StoredResponse, UnfinishedResponse
from app.serving.generation import GenerationFailed
from tenancy.quotas import TokenBucket
from tenancy.tenants import Tenant

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0
BUSY_STATUSES = (429, 503)  # the tenant's quota or the server is full for now: wait, not fail


@dataclass(slots=True)
class EventStream:
    """A streamed background response's events: what numbers them, and the log its readers follow."""

    events: ResponseEvents
    log: EventLog


class BackgroundResponses:
    def __init__(self, runner: ResponseRunner, store: ResponseStore) -> None:
        self.runner = runner
        self.store = store
        self.logs = EventLogs()
        settings = runner.context.settings
        self.readers = ReaderSlots(settings.tenant_max_reattached_streams, settings.tenant_reattaches_per_minute)
        self._runs: dict[str, tuple[asyncio.Task[None], ResponseHead]] = {}  # by response id, while running

    async def start(self) -> None:
        """Start again what a stopped server left queued or in progress."""
        for unfinished in await self.store.unfinished():
            head = _head_of(unfinished)
            if head is None:
                await self.store.move(None, unfinished.stored.response["id"], {
                    **unfinished.stored.response, "status": "failed",
                    "error": {"code": "server_error", "message": "The server restarted and cannot run it again."}})
            else:
                stream = self._open_stream(head) if head.body.is_streamed else None
                self._spawn(head, self._resume(unfinished, head, stream))

    async def stop(self) -> None:
        """Cancel the running ones; they stay active in the store, for the next server to run again."""
        tasks = [task for task, _ in self._runs.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def launch(self, run: ResponseRun) -> dict[str, Any]:
        """Store the response as queued and leave its generation to a task; the queued response."""
        queued = await self._store_queued(run)
        self._spawn(run.head, self._run(run))
        return queued

    async def launch_streamed(self, run: ResponseRun) -> EventLog:
        """As `launch`, the generation's events written into a log for the client to follow; the log,
        which holds `response.created` (queued) already."""
        await self._store_queued(run)
        stream = self._open_stream(run.head)
        self._spawn(run.head, self._run_streamed(run, stream))
        return stream.log

    def events_after(self, tenant_id: str, stored: StoredResponse, starting_after: int | None
                     ) -> AsyncGenerator[bytes, None]:
        """The stream of a background response created with stream=true, from the event after
        `starting_after`: its kept events, then the new ones until it ends; rebuilt from the stored
        response once they are no longer kept. Any other response is a 400, as OpenAI answers. A
        tenant's re-attached streams open at once are bounded: past the bound, a 429."""
        response = stored.response
        if not response.get("background"):
            raise APIError(400, "This response cannot be streamed because it was not created with background=true.",
                           param="stream")
        if not _was_streamed(stored):
            raise APIError(400, "This response cannot be streamed because it was not created with stream=true.",
                           param="stream")
        log = self.logs.get(response["id"])
        if log is None:  # its events were dropped, or it finished before a restart
            log = EventLog.ended(rebuilt_events(response))
        return self.readers.hold(tenant_id, log.frames_after(starting_after))

    async def cancel(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        """The response after a cancel (None: no such response of this tenant). A finished one is
        returned as it is; a running one is cancelled and its request aborted."""
        stored = await self.store.get(tenant_id, response_id)
        if stored is None:
            return None
        if not stored.response.get("background"):
            raise APIError(400, "Only a response created with background=true can be cancelled.",
                           param="response_id", code="not_cancellable")
        current, moved = await self.store.move(tenant_id, response_id, {**stored.response, "status": "cancelled"})
        if moved:
            await self.forget(response_id)
        return current

    async def forget(self, response_id: str) -> None:
        """Stop a response's generation, if it is running (it is cancelled or deleted); its stream ends."""
        running = self._runs.pop(response_id, None)
        if running is not None:
            running[0].cancel()
            await asyncio.gather(running[0], return_exceptions=True)
        self.logs.end(response_id)

    async def discard(self, response_id: str) -> None:
        """A deleted response: its generation stopped and its events dropped."""
        await self.forget(response_id)
        self.logs.drop(response_id)

    async def _store_queued(self, run: ResponseRun) -> dict[str, Any]:
        queued = run.head.render("queued")
        request = run.head.body.model_dump_json(by_alias=True, exclude_none=True)
        try:
            with storage_errors("the response"):
                await self.store.add(run.tenant.tenant_id, queued, run.items, self.runner.quota_of(run.tenant),
                                     request)
        except APIError:
            run.started.choices.generations[0].close()  # nobody could ever read it: abort the request
            raise
        return queued

    def _open_stream(self, head: ResponseHead) -> EventStream:
        events = ResponseEvents(head)
        log = self.logs.open(head.id)
        log.append(events.queued_opening())
        return EventStream(events, log)

    def _spawn(self, head: ResponseHead, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"fairlane-{head.id}")
        # A callback, not a `finally` in the work: it runs even for a task cancelled before it started.
        task.add_done_callback(lambda _: self._ended(head.id))
        self._runs[head.id] = (task, head)

    def _ended(self, response_id: str) -> None:
        """However its task ended, the response no longer runs here, and its log (if any) ends."""
        self._runs.pop(response_id, None)
        self.logs.end(response_id)

    async def _resume(self, unfinished: UnfinishedResponse, head: ResponseHead, stream: EventStream | None) -> None:
        tenants = self.runner.context.engine.tenants
        if not tenants.is_listed(unfinished.tenant):  # never under an unlimited stand-in
            await self._fail(head, f"The tenant '{unfinished.tenant}' is no longer served, so its background "
                                   "response cannot run.", stream)
            return
        tenant = tenants.get(unfinished.tenant)
        try:
            run = await self._start_again(tenant, head, unfinished.stored.items)
        except APIError as exc:
            await self._fail(head, exc.message, stream)
            return
        await (self._run(run) if stream is None else self._run_streamed(run, stream))

    async def _start_again(self, tenant: Tenant, head: ResponseHead, items: list[dict[str, Any]]) -> ResponseRun:
        """Start its generation, waiting while the engine or the tenant's quota turns it away."""
        while True:
            try:
                return await self.runner.start_conversation(tenant, head, items)
            except APIError as exc:
                if exc.status not in BUSY_STATUSES:
                    raise
            await asyncio.sleep(RETRY_DELAY_S)

    async def _run(self, run: ResponseRun) -> None:
        marker = asyncio.create_task(self._mark_in_progress(run))
        try:
            response = await self.runner.result(run)
        except GenerationFailed as exc:
            if self.runner.context.is_draining:
                return  # stopped with the server: it stays active, to run again after a restart
            response = failed(run.head, self.runner.failure(exc).message)
        finally:
            marker.cancel()
        await self._record(run.head.id, response)

    async def _run_streamed(self, run: ResponseRun, stream: EventStream) -> None:
        marker = asyncio.create_task(self._mark_in_progress(run))
        try:
            await self._publish(run, stream)
        except GenerationFailed as exc:
            if self.runner.context.is_draining:
                return  # as in _run; its stream ends without an end event
            await self._fail(run.head, self.runner.failure(exc).message, stream)
        finally:
            marker.cancel()

    async def _publish(self, run: ResponseRun, stream: EventStream) -> None:
        """Write the generation's events into the log as they come. Raises GenerationFailed."""
        async with aclosing(self.runner.event_batches(run, stream.events)) as batches:
            async for batch in batches:
                if stream.events.response is None:
                    stream.log.append(batch)
                else:
                    await self._publish_end(run.head.id, stream, batch)

    async def _fail(self, head: ResponseHead, message: str, stream: EventStream | None) -> None:
        if stream is None:
            await self._record(head.id, failed(head, message))
        else:
            await self._publish_end(head.id, stream, stream.events.fail(message, "server_error"))

    async def _publish_end(self, response_id: str, stream: EventStream, batch: list[bytes]) -> None:
        """Store the final response, then publish the batch that ends the stream: a reader who has seen
        the end finds it stored. A cancel stored first wins: the stream then ends without these."""
        assert stream.events.response is not None, "only the batch that ends the response is published last"
        if await self._record(response_id, stream.events.response):
            stream.log.append(batch)

    async def _record(self, response_id: str, response: dict[str, Any]) -> bool:
        """Store the response's new status; False if the stored one had already ended (cancelled or
        deleted meanwhile)."""
        try:
            _, moved = await self.store.move(None, response_id, response)
        except Exception:  # nobody waits on this task: the log is told
            logger.exception("background response %s could not be stored", response_id)
            return True  # the storing failed, not the response: its readers still get its end
        return moved

    async def _mark_in_progress(self, run: ResponseRun) -> None:
        await run.started.choices.generations[0].started.wait()
        await self._record(run.head.id, run.head.render("in_progress"))


class ReaderSlots:
    """Each tenant's re-attached streams open at once, and how often it re-attaches: a re-attachment
    holds a connection and a reader of a log, and costs no quota of the engine's, so without a bound one
    tenant could hold them all; and one to a response that has ended replays its whole log at once, so
    without a rate one tenant's loop of them takes the server's CPU from every other tenant."""

    def __init__(self, per_tenant: int, per_minute: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_tenant = per_tenant
        self.per_minute = per_minute
        self.open: Counter[str] = Counter()
        self._buckets: dict[str, TokenBucket] = {}
        self._clock = clock

    def hold(self, tenant_id: str, frames: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        if self.open[tenant_id] >= self.per_tenant:
            raise APIError(429, f"This tenant already follows {self.open[tenant_id]} response streams, its "
                                "limit; close one first.", type="rate_limit_error", code="rate_limit_exceeded")
        self._take_one(tenant_id)
        self.open[tenant_id] += 1
        return HeldFrames(frames, lambda: self._release(tenant_id))

    def _take_one(self, tenant_id: str) -> None:
        if self.per_minute is None:
            return
        now = self._clock()
        bucket = self._buckets.setdefault(tenant_id, TokenBucket(self.per_minute, self.per_minute, now))
        bucket.refill(now)
        if bucket.level < 1:
            wait_s = max(1, math.ceil(bucket.seconds_until(1)))
            raise APIError(429, f"This tenant re-attached to response streams {self.per_minute} times in the last "
                                f"minute, its limit; retry in {wait_s} s.", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"retry-after": str(wait_s)})
        bucket.level -= 1

    def _release(self, tenant_id: str) -> None:
        self.open[tenant_id] -= 1
        if not self.open[tenant_id]:
            del self.open[tenant_id]


class HeldFrames(AsyncGenerator[bytes, None]):
    """Frames that hold a slot until closed: by aclose, which the SSE response always calls (on an
    async generator never started, aclose would run none of its own cleanup)."""

    def __init__(self, frames: AsyncGenerator[bytes, None], release: Callable[[], None]) -> None:
        self._frames = frames
        self._release: Callable[[], None] | None = release

    async def asend(self, value: None) -> bytes:
        return await self._frames.asend(value)

    async def athrow(self, *args: Any) -> bytes:
        return await self._frames.athrow(*args)

    async def aclose(self) -> None:
        try:
            await self._frames.aclose()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


def _was_streamed(stored: StoredResponse) -> bool:
    """Whether the response was created with stream=true, as its stored request says."""
    if stored.request is None:
        return False
    try:
        return ResponsesBody.model_validate_json(stored.request).is_streamed
    except ValidationError:
        return False


def _head_of(unfinished: UnfinishedResponse) -> ResponseHead | None:
    """The head of a response to run again, from its stored request; None if it cannot be read."""
    response = unfinished.stored.response
    if unfinished.request is None:
        return None
    try:
        body = ResponsesBody.model_validate_json(unfinished.request)
    except ValidationError:
        return None
    return ResponseHead(response["id"], response["model"], body, response["created_at"])
