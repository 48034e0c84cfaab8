"""Runs batches: feeds their items into the engine a few at a time, as the batch class, under the
owning tenant; writes each result once; finalizes, expires and cancels batches.

Items enter gradually (at most `max_in_flight` across all batches), so a 50,000-line file neither
floods the queues nor memory. Everything is read back from the store, so a restarted server picks
up where the last one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from app.batch.service import move_to, output_line, unfinished_line
from app.batch.store import BatchStore, PendingItem

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0

# (tenant, url, body) -> (HTTP status, response body); runs one item like the HTTP endpoint would.
ItemExecutor = Callable[[str, str, dict[str, Any]], Awaitable[tuple[int, str, dict[str, Any]]]]


class RetryLater(Exception):
    """An item the server cannot take now (overloaded, or draining): it stays pending for a later try."""


class BatchRunner:
    def __init__(self, store: BatchStore, execute: ItemExecutor, *, max_in_flight: int = 32,
                 poll_seconds: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.execute = execute
        self.max_in_flight = max_in_flight
        self.poll_seconds = poll_seconds
        self.clock = clock
        self._in_flight: dict[tuple[str, int], asyncio.Task[None]] = {}
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
            try:
                self.tick()
            except Exception:  # a store hiccup must not end batch processing for good
                logger.exception("batch runner tick failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # the poll also notices expired windows
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)

    def tick(self) -> None:
        """One pass over the active batches."""
        now = int(self.clock())
        for batch in self.store.batches_with_status(("validating", "in_progress", "cancelling", "finalizing")):
            if batch["status"] == "validating":
                move_to(batch, "in_progress", now)
                self.store.save_batch(batch)
            if batch["status"] == "in_progress" and now >= batch["expires_at"]:
                self._end_early(batch, "expired", "batch_expired", "The batch's completion window ran out.")
            elif batch["status"] == "cancelling":
                self._end_early(batch, "cancelled", "batch_cancelled", "The batch was cancelled.")
            elif batch["status"] == "in_progress":
                self._feed(batch)

    def _feed(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        room = self.max_in_flight - len(self._in_flight) if self.clock() >= self._retry_after else 0
        running = {line for (b, line) in self._in_flight if b == batch_id}
        started = self.store.pending_items(batch_id, running, room) if room > 0 else []
        for item in started:
            self._in_flight[(batch_id, item.line)] = asyncio.create_task(self._run_item(batch, item))
        if not running and not started and not self.store.pending_items(batch_id, set(), 1):
            self._finalize(batch, "completed")

    async def _run_item(self, batch: dict[str, Any], item: PendingItem) -> None:
        tenant = self.store.batch_tenant(batch["id"]) or ""
        try:
            status, request_id, body = await self.execute(tenant, batch["endpoint"], item.body)
        except RetryLater:
            self._retry_after = self.clock() + RETRY_DELAY_S
        except Exception:  # a bug must fail this item once, not retry it forever
            logger.exception("batch item %s of %s failed", item.line, batch["id"])
            status, request_id, body = 500, "", {"error": {"message": "The server had an error while "
                                                           "running this request.", "type": "server_error",
                                                           "param": None, "code": None}}
            self.store.record_result(batch["id"], item.line, False,
                                     output_line(item.custom_id, request_id, status, body))
        else:
            self.store.record_result(batch["id"], item.line, status == 200,
                                     output_line(item.custom_id, request_id, status, body))
        finally:
            self._in_flight.pop((batch["id"], item.line), None)
            self._wake.set()

    def _end_early(self, batch: dict[str, Any], final_status: str, code: str, message: str) -> None:
        """Expire or cancel: stop running items (they stay unwritten), keep finished results."""
        for (batch_id, _), task in list(self._in_flight.items()):
            if batch_id == batch["id"]:
                task.cancel()
        if any(b == batch["id"] for b, _ in self._in_flight):
            return  # finalize on a later tick, once the cancelled items have let go
        for line, custom_id in self.store.pending_custom_ids(batch["id"]):
            self.store.record_result(batch["id"], line, False, unfinished_line(custom_id, code, message))
        self._finalize(batch, final_status)

    def _finalize(self, batch: dict[str, Any], final_status: str) -> None:
        now = int(self.clock())
        tenant = self.store.batch_tenant(batch["id"]) or ""
        move_to(batch, "finalizing", now)
        succeeded = self.store.results(batch["id"], "succeeded")
        failed = self.store.results(batch["id"], "failed")
        if succeeded:
            batch["output_file_id"] = self.store.add_file(
                tenant, f"{batch['id']}_output.jsonl", "batch_output", _jsonl(succeeded)).id
        if failed:
            batch["error_file_id"] = self.store.add_file(
                tenant, f"{batch['id']}_error.jsonl", "batch_output", _jsonl(failed)).id
        batch["request_counts"] = self.counts(batch["id"])
        move_to(batch, final_status, now)
        self.store.save_batch(batch)

    def counts(self, batch_id: str) -> dict[str, int]:
        counts = self.store.item_counts(batch_id)
        return {"total": sum(counts.values()), "completed": counts["succeeded"], "failed": counts["failed"]}


def _jsonl(lines: list[str]) -> bytes:
    return b"".join(orjson.dumps(orjson.loads(line)) + b"\n" for line in lines)
