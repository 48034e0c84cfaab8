"""The stored responses' table: one tenant's rows apart from another's, status changes only from an
active response, and what a stopped server left running found again by the next one."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.batch.database import StorageQuotaExceeded
from app.responses.store import ResponseQuota, ResponseStore

ITEMS = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}],
          "status": "completed"}]


ROOMY = ResponseQuota(max_responses=100, max_bytes=1 << 20, max_background=10)


def response(response_id: str, status: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "status": status, "output": [], "error": None}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ResponseStore]:
    opened = ResponseStore(tmp_path / "fairlane.db")
    yield opened
    await opened.close()


async def test_a_response_is_its_tenants_only(store: ResponseStore) -> None:
    await store.add("alice", response("resp_1", "completed"), ITEMS, ROOMY)

    stored = await store.get("alice", "resp_1")
    assert stored is not None and stored.items == ITEMS and stored.response["status"] == "completed"
    assert await store.get("bob", "resp_1") is None
    assert await store.delete("bob", "resp_1") is False
    assert await store.move("bob", "resp_1", response("resp_1", "cancelled")) == (None, False)
    assert await store.delete("alice", "resp_1") is True
    assert await store.get("alice", "resp_1") is None


async def test_only_an_active_response_changes_status(store: ResponseStore) -> None:
    await store.add("alice", response("resp_1", "queued"), ITEMS, ROOMY)

    cancelled, moved = await store.move("alice", "resp_1", response("resp_1", "cancelled"))
    assert moved and cancelled is not None and cancelled["status"] == "cancelled"
    current, moved = await store.move(None, "resp_1", response("resp_1", "completed"))  # the generation ends late
    assert not moved and current is not None and current["status"] == "cancelled"


async def test_a_reopened_store_finds_what_was_left_running(tmp_path: Path) -> None:
    path = tmp_path / "fairlane.db"
    before = ResponseStore(path)
    for response_id, status in [("resp_q", "queued"), ("resp_p", "in_progress"), ("resp_c", "completed")]:
        await before.add("alice", response(response_id, status), ITEMS, ROOMY, request=f'{{"id": "{response_id}"}}')
    await before.close()

    after = ResponseStore(path)
    try:
        unfinished = await after.unfinished()
    finally:
        await after.close()
    assert sorted((u.tenant, u.stored.response["id"], u.request) for u in unfinished) == [
        ("alice", "resp_p", '{"id": "resp_p"}'), ("alice", "resp_q", '{"id": "resp_q"}')]
    assert all(u.stored.items == ITEMS for u in unfinished)


async def test_past_its_quota_a_tenant_loses_its_own_oldest_finished_responses(store: ResponseStore) -> None:
    quota = ResponseQuota(max_responses=3, max_bytes=1 << 20, max_background=10)
    await store.add("bob", response("resp_bob", "completed"), ITEMS, quota)
    await store.add("alice", response("resp_running", "in_progress"), ITEMS, quota, request="{}")
    for number in range(4):
        await store.add("alice", response(f"resp_{number}", "completed"), ITEMS, quota)

    kept = [rid for rid in ("resp_running", "resp_0", "resp_1", "resp_2", "resp_3") if await store.get("alice", rid)]
    assert kept == ["resp_running", "resp_2", "resp_3"]  # the oldest finished went; the running one stays
    assert await store.get("bob", "resp_bob") is not None  # another tenant's are never touched


async def test_the_bytes_bound_makes_room_and_refuses_what_can_never_fit(store: ResponseStore) -> None:
    one = len(str(response("resp_0", "completed"))) + len(str(ITEMS))  # about one response's bytes
    quota = ResponseQuota(max_responses=100, max_bytes=3 * one, max_background=10)
    for number in range(5):
        await store.add("alice", response(f"resp_{number}", "completed"), ITEMS, quota)
    assert await store.get("alice", "resp_0") is None and await store.get("alice", "resp_4") is not None

    huge = [{**ITEMS[0], "content": [{"type": "input_text", "text": "x" * 4 * one}]}]
    with pytest.raises(StorageQuotaExceeded, match="larger than"):
        await store.add("alice", response("resp_huge", "completed"), huge, quota)
    assert await store.get("alice", "resp_4") is not None  # nothing was deleted for a response refused


async def test_background_responses_at_once_are_bounded(store: ResponseStore) -> None:
    quota = ResponseQuota(max_responses=100, max_bytes=1 << 20, max_background=2)
    await store.add("alice", response("resp_1", "queued"), ITEMS, quota, request="{}")
    await store.add("alice", response("resp_2", "in_progress"), ITEMS, quota, request="{}")
    with pytest.raises(StorageQuotaExceeded, match="background"):
        await store.add("alice", response("resp_3", "queued"), ITEMS, quota, request="{}")
    await store.add("bob", response("resp_4", "queued"), ITEMS, quota, request="{}")  # bob has his own
    await store.move("alice", "resp_1", response("resp_1", "completed"))
    await store.add("alice", response("resp_3", "queued"), ITEMS, quota, request="{}")


async def test_a_database_from_before_the_quotas_gets_each_responses_size(tmp_path: Path) -> None:
    path = tmp_path / "fairlane.db"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, "
                    "data TEXT NOT NULL, items TEXT NOT NULL, request TEXT)")
        old.execute("INSERT INTO responses VALUES ('resp_old', 'alice', 'completed', ?, ?, NULL)",
                    (json.dumps(response("resp_old", "completed")), json.dumps(ITEMS)))
    store = ResponseStore(path)
    try:
        assert await store.get("alice", "resp_old") is not None
        await store.add("alice", response("resp_new", "completed"), ITEMS,
                        ResponseQuota(max_responses=1, max_bytes=1 << 20, max_background=1))
        assert await store.get("alice", "resp_old") is None
    finally:
        await store.close()
    with sqlite3.connect(path) as reopened:
        assert reopened.execute("SELECT bytes FROM responses WHERE id = 'resp_new'").fetchone()[0] > 100
