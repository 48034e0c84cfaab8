"""Runs batches: feeds their items into the engine a few at a time, as the batch class, under the
owning tenant; writes each result once; finalizes, expires and cancels batches.

Items enter gradually (at most `max_in_flight` across all batches), so a 50,000-line file neither
floods the queues nor memory. Everything is read back from the store, so a restarted server picks
up where the last one stopped.

A result that cannot be stored (a full disk) fails its batch: the engine already ran that item,
so running it again would charge the tenant twice for a result that may be lost again. The batch
stops being fed at once; it is marked `failed` (with an `errors` entry, keeping every result already
stored) as soon as the store can take that one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from app.batch import finish
from app.batch.database import StorageFull
from app.batch.service import RUNNER_STATUSES, output_line
from app.batch.store import ActiveBatch, BatchStore, PendingItem
from app.serving.items import ItemExecutor, RetryLater

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0
SERVER_ERROR_BODY = {"error": {"message": "The server had an error while running this request.",
                               "type": "server_error", "param": None, "code": None}}

class BatchRunner:
    def __init__(self, store: BatchStore, execute: ItemExecutor, *, max_in_flight: int = 32,
                 poll_seconds: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.execute = execute
        self.max_in_flight = max_in_flight
        self.poll_seconds = poll_seconds
        self.clock = clock
        self._in_flight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._failing: dict[str, str] = {}  # batch id -> why a result of it could not be stored
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._retry_after = 0.0  # while the engine turns items away, feeding pauses until then

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fairlane-batches")

    async def stop(self) -> None:
        """Stop feeding; running items are aborted and stay pending, to run again after a restart."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before the tick: a wake-up during it means "look again"
            await self.tick()
            with contextlib.suppress(TimeoutError):  # the poll also notices expired windows
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)

    async def tick(self) -> None:
        """One pass over the active batches; a failing batch does not hold up the others."""
        try:
            batches = await self.store.active_batches(RUNNER_STATUSES)
        except Exception:  # a store hiccup must not end batch processing for good
            logger.exception("batch runner could not list the active batches")
            return
        for batch in batches:
            try:
                await self._advance(batch, int(self.clock()))
            except Exception:
                logger.exception("batch runner could not advance %s", batch.id)

    async def _advance(self, batch: ActiveBatch, now: int) -> None:
        status = batch.status
        if batch.id in self._failing:
            await self._end_early(batch, finish.failed(self._failing[batch.id]), now)
            return
        if status == "validating":
            _, moved = await self.store.move_batch(None, batch.id, ("validating",), "in_progress", now)
            status = "in_progress" if moved else status
        if status == "in_progress" and now >= batch.expires_at:
            await self._end_early(batch, finish.EXPIRED, now)
        elif status == "cancelling":
            await self._end_early(batch, finish.CANCELLED, now)
        elif status == "in_progress":
            await self._feed(batch, now)

    async def _feed(self, batch: ActiveBatch, now: int) -> None:
        room = self.max_in_flight - len(self._in_flight) if self.clock() >= self._retry_after else 0
        if room <= 0:
            return
        running = {line for (b, line) in self._in_flight if b == batch.id}
        started = await self.store.pending_items(batch.id, running, room)
        for item in started:
            self._in_flight[(batch.id, item.line)] = asyncio.create_task(self._run_item(batch, item))
        if not running and not started:  # nothing left pending; the store checks again as it finishes
            await self.store.finish_batch(batch.id, finish.COMPLETED, now)

    async def _run_item(self, batch: ActiveBatch, item: PendingItem) -> None:
        try:
            outcome = await self._execute(batch, item)
            if outcome is not None:
                await self.store.record_result(batch.id, item.line, *outcome)
        except Exception as exc:  # the result is lost: fail the batch rather than run the item again
            logger.error("batch %s: the result of line %d could not be stored (%s); failing the batch",
                         batch.id, item.line, exc)
            self._failing.setdefault(batch.id, _lost_result_reason(exc))
        finally:
            self._in_flight.pop((batch.id, item.line), None)
            self._wake.set()

    async def _execute(self, batch: ActiveBatch, item: PendingItem) -> tuple[bool, dict[str, Any]] | None:
        """(succeeded, output line), or None when the item must wait for a later try."""
        try:
            status, request_id, body = await self.execute(batch.tenant, batch.endpoint, item.body)
        except RetryLater:
            self._retry_after = self.clock() + RETRY_DELAY_S
            return None
        except Exception:  # a bug must fail this item once, not retry it forever
            logger.exception("batch item %s of %s failed", item.line, batch.id)
            status, request_id, body = 500, "", SERVER_ERROR_BODY
        return status == 200, output_line(item.custom_id, request_id, status, body)

    async def _end_early(self, batch: ActiveBatch, ending: finish.Ending, now: int) -> None:
        """Expire, cancel or fail: stop running items (they stay unwritten), keep finished results."""
        for (batch_id, _), task in list(self._in_flight.items()):
            if batch_id == batch.id:
                task.cancel()
        if any(b == batch.id for b, _ in self._in_flight):
            return  # finish on a later tick, once the cancelled items have let go
        await self.store.finish_batch(batch.id, ending, now)
        self._failing.pop(batch.id, None)

    async def counts(self, batch_id: str) -> dict[str, int]:
        counts = await self.store.item_counts(batch_id)
        return {"total": sum(counts.values()), "completed": counts["succeeded"], "failed": counts["failed"]}


def _lost_result_reason(exc: Exception) -> str:
    """What the batch's error says: the cause, but no server path or SQL (those go to the log)."""
    if isinstance(exc, StorageFull):
        return "the server's storage is full, so a result could not be stored."
    return "a result could not be stored."
