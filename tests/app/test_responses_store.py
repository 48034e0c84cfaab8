"""The stored responses' table: one tenant's rows apart from another's, status changes only from an
active response, and what a stopped server left running found again by the next one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.responses.store import ResponseStore

ITEMS = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}],
          "status": "completed"}]


def response(response_id: str, status: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "status": status, "output": [], "error": None}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ResponseStore]:
    opened = ResponseStore(tmp_path / "fairlane.db")
    yield opened
    await opened.close()


async def test_a_response_is_its_tenants_only(store: ResponseStore) -> None:
    await store.add("alice", response("resp_1", "completed"), ITEMS)

    stored = await store.get("alice", "resp_1")
    assert stored is not None and stored.items == ITEMS and stored.response["status"] == "completed"
    assert await store.get("bob", "resp_1") is None
    assert await store.delete("bob", "resp_1") is False
    assert await store.move("bob", "resp_1", response("resp_1", "cancelled")) == (None, False)
    assert await store.delete("alice", "resp_1") is True
    assert await store.get("alice", "resp_1") is None


async def test_only_an_active_response_changes_status(store: ResponseStore) -> None:
    await store.add("alice", response("resp_1", "queued"), ITEMS)

    cancelled, moved = await store.move("alice", "resp_1", response("resp_1", "cancelled"))
    assert moved and cancelled is not None and cancelled["status"] == "cancelled"
    current, moved = await store.move(None, "resp_1", response("resp_1", "completed"))  # the generation ends late
    assert not moved and current is not None and current["status"] == "cancelled"


async def test_a_reopened_store_finds_what_was_left_running(tmp_path: Path) -> None:
    path = tmp_path / "fairlane.db"
    before = ResponseStore(path)
    for response_id, status in [("resp_q", "queued"), ("resp_p", "in_progress"), ("resp_c", "completed")]:
        await before.add("alice", response(response_id, status), ITEMS, request=f'{{"id": "{response_id}"}}')
    await before.close()

    after = ResponseStore(path)
    try:
        unfinished = await after.unfinished()
    finally:
        await after.close()
    assert sorted((u.tenant, u.stored.response["id"], u.request) for u in unfinished) == [
        ("alice", "resp_p", '{"id": "resp_p"}'), ("alice", "resp_q", '{"id": "resp_q"}')]
    assert all(u.stored.items == ITEMS for u in unfinished)
