"""Background responses: stored `queued` at once, generated in the batch class by a task of their
own, `in_progress` from their first token, polled with GET and cancelled by id.

Every status change goes through the store's `move`, which changes only an active response: a cancel
and the end of a generation never overwrite each other, whichever is written first. Like Batch API
items, a background response survives a restart: one a stopped (or killed) server left active is
started again from its stored request and conversation when the next server starts; while the engine
or the tenant's quota turns it away, it stays queued and is tried again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from pydantic import ValidationError

from app.batch.uploads import storage_errors
from app.plumbing.errors import APIError
from app.responses.objects import ResponseHead, failed
from app.responses.runs import ResponseRun, ResponseRunner
from app.responses.schemas import ResponsesBody
from app.responses.store import ResponseStore, UnfinishedResponse
from app.serving.generation import GenerationFailed

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0
BUSY_STATUSES = (429, 503)  # the tenant's quota or the server is full for now: wait, not fail


class BackgroundResponses:
    def __init__(self, runner: ResponseRunner, store: ResponseStore) -> None:
        self.runner = runner
        self.store = store
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
                self._spawn(head, self._resume(unfinished, head))

    async def stop(self) -> None:
        """Cancel the running ones; they stay active in the store, for the next server to run again."""
        tasks = [task for task, _ in self._runs.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def launch(self, run: ResponseRun) -> dict[str, Any]:
        """Store the response as queued and leave its generation to a task; the queued response."""
        queued = run.head.render("queued")
        request = run.head.body.model_dump_json(by_alias=True, exclude_none=True)
        try:
            with storage_errors("the response"):
                await self.store.add(run.tenant.tenant_id, queued, run.items, request)
        except APIError:
            run.started.choices.generations[0].close()  # nobody could ever read it: abort the request
            raise
        self._spawn(run.head, self._run(run))
        return queued

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
        """Stop a response's generation, if it is running (it is cancelled or deleted)."""
        running = self._runs.pop(response_id, None)
        if running is not None:
            running[0].cancel()
            await asyncio.gather(running[0], return_exceptions=True)

    def _spawn(self, head: ResponseHead, work: Coroutine[Any, Any, None]) -> None:
        self._runs[head.id] = (asyncio.create_task(work, name=f"fairlane-{head.id}"), head)

    async def _resume(self, unfinished: UnfinishedResponse, head: ResponseHead) -> None:
        tenant = self.runner.context.engine.tenants.get(unfinished.tenant)
        while True:
            try:
                run = await self.runner.start_conversation(tenant, head, unfinished.stored.items)
            except APIError as exc:
                if exc.status in BUSY_STATUSES:
                    await asyncio.sleep(RETRY_DELAY_S)
                    continue
                await self._record(head.id, failed(head, exc.message))
                self._runs.pop(head.id, None)
                return
            await self._run(run)
            return

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
            self._runs.pop(run.head.id, None)
        await self._record(run.head.id, response)

    async def _record(self, response_id: str, response: dict[str, Any]) -> None:
        try:
            await self.store.move(None, response_id, response)
        except Exception:  # nobody waits on this task: the log is told
            logger.exception("background response %s could not be stored", response_id)

    async def _mark_in_progress(self, run: ResponseRun) -> None:
        await run.started.choices.generations[0].started.wait()
        await self._record(run.head.id, run.head.render("in_progress"))


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
