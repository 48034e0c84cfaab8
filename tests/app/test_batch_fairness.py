"""The batch runner shares its in-flight slots among tenants by weight: a second tenant's small batch
progresses beside a first tenant's large one instead of waiting for all of it, and an item turned away
for now pauses its own tenant only. Over a real SQLite store; the items run on a fake executor that
takes a fixed time (the engine's own fairness is tested in tests/scheduling)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from app.batch.runner import BatchRunner
from app.batch.service import new_batch
from app.batch.store import BatchStore
from app.serving.items import RetryLater

ITEM_SECONDS = 0.005


async def add_batch(store: BatchStore, tenant: str, num_items: int) -> str:
    batch = new_batch("file-x", "/v1/completions", "24h", None)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1})
    await store.add_batch(tenant, batch, [(f"{tenant}-{i}", body) for i in range(num_items)])
    return str(batch["id"])


class Executor:
    """Runs each item in a fixed time; counts what each tenant got done; turns away `refused` tenants."""

    def __init__(self, refused: frozenset[str] = frozenset()) -> None:
        self.done: Counter[str] = Counter()
        self.refused = refused
        self.in_flight: Counter[str] = Counter()
        self.most_in_flight: Counter[str] = Counter()

    async def __call__(self, tenant: str, url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
        if tenant in self.refused:
            raise RetryLater("this tenant's quota is spent")
        self.in_flight[tenant] += 1
        self.most_in_flight[tenant] = max(self.most_in_flight[tenant], self.in_flight[tenant])
        try:
            await asyncio.sleep(ITEM_SECONDS)
        finally:
            self.in_flight[tenant] -= 1
        self.done[tenant] += 1
        return 200, "cmpl-1", {"choices": []}


async def run_until(runner: BatchRunner, store: BatchStore, batch_id: str, timeout: float = 20.0) -> None:
    async def ended() -> bool:
        counts = await store.item_counts(batch_id)
        return counts["succeeded"] + counts["failed"] == sum(counts.values())

    runner.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await ended():
            assert asyncio.get_running_loop().time() < deadline, "the batch did not finish in time"
            await asyncio.sleep(0.01)
    finally:
        await runner.stop()


async def test_a_small_batch_progresses_beside_an_earlier_large_one(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.db")
    executor = Executor()
    await add_batch(store, "alice", 400)
    small = await add_batch(store, "bob", 20)
    runner = BatchRunner(store, executor, max_in_flight=8, poll_seconds=0.05)
    await run_until(runner, store, small)
    # Equal weights: bob's 20 items took about 20 of alice's, not all 400 (first in, first out did).
    assert executor.done["bob"] == 20
    assert executor.done["alice"] <= 20 + 8
    assert executor.most_in_flight["bob"] >= 3
    await store.close()


async def test_slots_follow_the_tenants_weights(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.db")
    executor = Executor()
    await add_batch(store, "alice", 400)
    heavy = await add_batch(store, "bob", 60)
    weights = {"alice": 1.0, "bob": 3.0}
    runner = BatchRunner(store, executor, max_in_flight=8, poll_seconds=0.05, weight_of=weights.__getitem__)
    await run_until(runner, store, heavy)
    assert 12 <= executor.done["alice"] <= 20 + 8  # a third of bob's 60, give or take the slots
    assert executor.most_in_flight["bob"] == 6  # 3/4 of the 8 slots
    await store.close()


async def test_a_tenant_turned_away_does_not_pause_the_others(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.db")
    executor = Executor(refused=frozenset({"alice"}))
    await add_batch(store, "alice", 50)
    other = await add_batch(store, "bob", 30)
    runner = BatchRunner(store, executor, max_in_flight=4, poll_seconds=0.05)
    started = asyncio.get_running_loop().time()
    await run_until(runner, store, other)
    # 30 items in 4 slots at 5 ms is well under a second: no pause of RETRY_DELAY_S per turned-away item.
    assert asyncio.get_running_loop().time() - started < 3.0
    assert executor.done["alice"] == 0
    assert (await store.item_counts(other))["succeeded"] == 30
    await store.close()


async def test_a_batch_of_a_tenant_no_longer_listed_fails_with_the_reason(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.db")
    executor = Executor()
    gone = await add_batch(store, "mallory", 5)
    kept = await add_batch(store, "bob", 5)
    runner = BatchRunner(store, executor, max_in_flight=4, poll_seconds=0.05, is_tenant=lambda t: t != "mallory")
    await run_until(runner, store, kept)
    ended = await store.get_batch("mallory", gone)
    assert ended is not None and ended["status"] == "failed"
    assert "tenant 'mallory' is no longer served" in json.dumps(ended["errors"])
    assert executor.done == Counter({"bob": 5})
    await store.close()


class NotingEvent(asyncio.Event):
    """An event that says when someone first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.awaited.set()
        return await super().wait()


async def test_stop_ends_the_runner_even_as_it_is_woken(tmp_path: Path) -> None:
    """A wake-up in the same moment as the stop's cancel: Python 3.11's wait_for swallowed the cancel,
    and stop() waited forever (seen once in the suite, as a 300 s timeout of the test above)."""
    store = BatchStore(tmp_path / "batches.db")
    runner = BatchRunner(store, Executor(), max_in_flight=4, poll_seconds=30.0)
    wake = runner._wake = NotingEvent()  # the test waits for the runner to wait on it
    runner.start()
    await asyncio.wait_for(wake.awaited.wait(), timeout=10.0)  # the runner is between ticks, waiting
    runner.wake()
    await asyncio.wait_for(runner.stop(), timeout=5.0)
    await store.close()
