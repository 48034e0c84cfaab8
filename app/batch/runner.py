"""Runs batches: feeds their items into the engine a few at a time, as the batch class, under the
owning tenant; writes each result once; finalizes, expires and cancels batches.

Items enter gradually (at most `max_in_flight` across all batches), so a 50,000-line file neither
floods the queues nor memory. Everything is read back from the store, so a restarted server picks
up where the last one stopped.

The in-flight slots are shared by tenant weight, not handed out oldest batch first: each free slot
goes to the tenant with the fewest items in flight per unit of weight among those with items pending,
and within a tenant to its batch with the fewest in flight. So every tenant with a pending batch has
items in the engine, whose fair queues then decide; before, a 400-line batch took every slot and a
second tenant's 20-line batch waited for all 400. An item the engine turns away for now (the tenant's
quota, an overloaded server) pauses that tenant's feeding only.

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
from collections import Counter
from collections.abc import Callable, Sequence
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
                 poll_seconds: float = 1.0, clock: Callable[[], float] = time.time,
                 weight_of: Callable[[str], float] = lambda tenant: 1.0,
                 is_tenant: Callable[[str], bool] = lambda tenant: True) -> None:
        self.store = store
        self.execute = execute
        self.max_in_flight = max_in_flight
        self.poll_seconds = poll_seconds
        self.clock = clock
        self.weight_of = weight_of  # a tenant's share of the in-flight slots
        self.is_tenant = is_tenant  # False for an owner the tenants file no longer lists
        self._in_flight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._tenant_of: dict[str, str] = {}  # batch id -> tenant, for the batches with items in flight
        self._failing: dict[str, str] = {}  # batch id -> why a result of it could not be stored
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # per tenant: while the engine turns its items away, feeding that tenant pauses until then
        self._retry_after: dict[str, float] = {}

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
            # The poll also notices expired windows. asyncio.timeout, not wait_for: on Python 3.11 wait_for
            # swallows a cancel that comes as the event is set, and stop() then waited forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_seconds):
                    await self._wake.wait()

    async def tick(self) -> None:
        """One pass over the active batches; a failing batch does not hold up the others."""
        try:
            batches = await self.store.active_batches(RUNNER_STATUSES)
        except Exception:  # a store hiccup must not end batch processing for good
            logger.exception("batch runner could not list the active batches")
            return
        feedable: list[ActiveBatch] = []
        for batch in batches:
            try:
                if await self._advance(batch, int(self.clock())):
                    feedable.append(batch)
            except Exception:
                logger.exception("batch runner could not advance %s", batch.id)
        try:
            await self._feed(feedable, int(self.clock()))
        except Exception:
            logger.exception("batch runner could not feed the batches")

    async def _advance(self, batch: ActiveBatch, now: int) -> bool:
        """Move the batch along its statuses; True when it is in progress and may be fed."""
        status = batch.status
        if batch.id in self._failing:
            await self._end_early(batch, finish.failed(self._failing[batch.id]), now)
            return False
        if status == "validating":
            _, moved = await self.store.move_batch(None, batch.id, ("validating",), "in_progress", now)
            status = "in_progress" if moved else status
        if status == "in_progress" and not self.is_tenant(batch.tenant):
            await self._end_early(batch, finish.failed(f"its tenant '{batch.tenant}' is no longer served by "
                                                       "this server."), now)
        elif status == "in_progress" and now >= batch.expires_at:
            await self._end_early(batch, finish.EXPIRED, now)
        elif status == "cancelling":
            await self._end_early(batch, finish.CANCELLED, now)
        else:
            return status == "in_progress"
        return False

    async def _feed(self, batches: Sequence[ActiveBatch], now: int) -> None:
        """Offer the free slots to the batches' pending items by tenant weight (see the module's note), and
        complete the batches with nothing left to run."""
        room = self.max_in_flight - len(self._in_flight)
        pending: dict[str, list[PendingItem]] = {}
        for batch in batches:
            running = {line for (b, line) in self._in_flight if b == batch.id}
            # At least one, even without room: an empty answer is what says the batch is done.
            pending[batch.id] = await self.store.pending_items(batch.id, running, max(room, 1))
            if not running and not pending[batch.id]:  # the store checks again as it finishes
                await self.store.finish_batch(batch.id, finish.COMPLETED, now)
        for batch, item in self._fair_order(batches, pending, room):
            self._tenant_of[batch.id] = batch.tenant
            self._in_flight[(batch.id, item.line)] = asyncio.create_task(self._run_item(batch, item))

    def _fair_order(self, batches: Sequence[ActiveBatch], pending: dict[str, list[PendingItem]], room: int
                    ) -> list[tuple[ActiveBatch, PendingItem]]:
        """Up to `room` items, each to the tenant with the fewest in flight per weight (then its batch with
        the fewest in flight, the oldest on a tie), skipping tenants whose items were just turned away."""
        per_batch = Counter(batch_id for batch_id, _ in self._in_flight)
        per_tenant = Counter({tenant: 0 for tenant in self._tenant_of.values()})
        for batch_id, count in per_batch.items():
            per_tenant[self._tenant_of[batch_id]] += count
        paused = {tenant for tenant, until in self._retry_after.items() if self.clock() < until}
        queues = {batch.id: list(reversed(pending[batch.id])) for batch in batches if batch.tenant not in paused}
        chosen: list[tuple[ActiveBatch, PendingItem]] = []
        while len(chosen) < room:
            ready = [batch for batch in batches if queues.get(batch.id)]
            if not ready:
                break
            batch = min(ready, key=lambda b: (per_tenant[b.tenant] / self.weight_of(b.tenant), per_batch[b.id]))
            chosen.append((batch, queues[batch.id].pop()))
            per_tenant[batch.tenant] += 1
            per_batch[batch.id] += 1
        return chosen

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
            if not any(b == batch.id for b, _ in self._in_flight):
                self._tenant_of.pop(batch.id, None)
            self._wake.set()

    async def _execute(self, batch: ActiveBatch, item: PendingItem) -> tuple[bool, dict[str, Any]] | None:
        """(succeeded, output line), or None when the item must wait for a later try."""
        try:
            status, request_id, body = await self.execute(batch.tenant, batch.endpoint, item.body)
        except RetryLater:
            self._retry_after[batch.tenant] = self.clock() + RETRY_DELAY_S
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
