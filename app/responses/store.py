"""Stored responses in the server's SQLite database (the Batch API's file, its own table).

Every read and write names the tenant: another tenant's response is as absent as one never made.
The SQL runs on a database thread (app/batch/database.py), never on the event loop. A background
response changes status only from an active one (queued, in_progress), checked and written in one
transaction, so a cancel and the end of the generation never overwrite each other. A background
response keeps its request body, so that one a stopped server left active runs again at start-up.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.batch.database import DatabaseThread, StorageQuotaExceeded, transaction
from app.responses.objects import ACTIVE_STATUSES


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object
    items: list[dict[str, Any]]  # the conversation's input items, canonical (app/responses/translate.py)
    request: str | None = None  # a background response's request body (JSON); None for the others


@dataclass(slots=True, frozen=True)
class ResponseQuota:
    """What one tenant may keep: stored responses and their bytes (past either, its oldest finished ones
    go to make room), and background responses queued or running at once (past that, a new one is
    refused)."""

    max_responses: int
    max_bytes: int
    max_background: int


@dataclass(slots=True, frozen=True)
class UnfinishedResponse:
    """A background response a stopped server left queued or in progress."""

    tenant: str
    stored: StoredResponse
    request: str | None  # its request body (JSON), to run it again


class ResponseStore:
    def __init__(self, path: str | Path) -> None:
        """Opens and checks the database (DatabaseUnusable if it is not a sound SQLite file)."""
        self._db = DatabaseThread(Path(path))

    async def close(self) -> None:
        await self._db.close()

    async def add(self, tenant: str, response: dict[str, Any], items: list[dict[str, Any]], quota: ResponseQuota,
                  request: str | None = None) -> None:
        """Store a response; a background one with its request body (JSON), to run it after a restart.
        Within the tenant's quota: raises StorageQuotaExceeded if it cannot be made to fit."""
        await self._db.run(_insert, tenant, response, items, request, quota)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._db.run(_select, tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._db.run(_delete, tenant, response_id)

    async def move(self, tenant: str | None, response_id: str, response: dict[str, Any]
                   ) -> tuple[dict[str, Any] | None, bool]:
        """Replace a response that is still active (queued or in_progress) with `response`. Returns the
        response as it is afterwards (None: no such response, or deleted) and whether it was replaced."""
        return await self._db.run(_move, tenant, response_id, response)

    async def unfinished(self) -> list[UnfinishedResponse]:
        """Background responses still queued or in progress (at start-up: left by a stopped server)."""
        return await self._db.run(_select_unfinished)


# ---- on the database thread ---------------------------------------------------------------


def _insert(db: sqlite3.Connection, tenant: str, response: dict[str, Any], items: list[dict[str, Any]],
            request: str | None, quota: ResponseQuota) -> None:
    data, items_json = json.dumps(response), json.dumps(items)
    size = _size(data, items_json, request)
    with transaction(db):
        if request is not None:
            _check_background(db, tenant, quota)
        _make_room(db, tenant, size, quota)
        db.execute("INSERT INTO responses (id, tenant, status, data, items, request, bytes) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (response["id"], tenant, response["status"], data, items_json, request, size))


def _size(*texts: str | None) -> int:
    return sum(len(text.encode()) for text in texts if text is not None)


def _check_background(db: sqlite3.Connection, tenant: str, quota: ResponseQuota) -> None:
    marks = ", ".join("?" * len(ACTIVE_STATUSES))
    active = db.execute(f"SELECT COUNT(*) FROM responses WHERE tenant = ? AND status IN ({marks})",
                        (tenant, *ACTIVE_STATUSES)).fetchone()[0]
    if active >= quota.max_background:
        raise StorageQuotaExceeded(f"this tenant already has {active} background responses queued or in progress, "
                                   "its limit; wait for one to finish or cancel one")


def _make_room(db: sqlite3.Connection, tenant: str, size: int, quota: ResponseQuota) -> None:
    """Delete the tenant's oldest finished responses until one more of `size` bytes fits its quota; a
    conversation continued from a deleted one is not lost with it (each response keeps its whole
    conversation). Raises StorageQuotaExceeded if the response cannot fit even so."""
    if size > quota.max_bytes:
        raise StorageQuotaExceeded(f"this response ({size} bytes with its conversation) is larger than this "
                                   f"tenant's whole limit of {quota.max_bytes} bytes of stored responses; "
                                   "send it with store: false")
    count, stored_bytes = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ?",
                                     (tenant,)).fetchone()
    marks = ", ".join("?" * len(ACTIVE_STATUSES))
    oldest_finished = db.execute(f"SELECT rowid, bytes FROM responses WHERE tenant = ? AND status NOT IN ({marks}) "
                                 "ORDER BY rowid", (tenant, *ACTIVE_STATUSES))
    doomed: list[int] = []
    while count + 1 > quota.max_responses or stored_bytes + size > quota.max_bytes:
        row = oldest_finished.fetchone()
        if row is None:
            raise StorageQuotaExceeded("this tenant's background responses in progress fill its storage limit; "
                                       "wait for one to finish or cancel one")
        doomed.append(row[0])
        count, stored_bytes = count - 1, stored_bytes - row[1]
    oldest_finished.close()
    db.executemany("DELETE FROM responses WHERE rowid = ?", [(rowid,) for rowid in doomed])


def _select(db: sqlite3.Connection, tenant: str, response_id: str) -> StoredResponse | None:
    row = db.execute("SELECT data, items, request FROM responses WHERE id = ? AND tenant = ?",
                     (response_id, tenant)).fetchone()
    return StoredResponse(json.loads(row[0]), json.loads(row[1]), row[2]) if row else None


def _delete(db: sqlite3.Connection, tenant: str, response_id: str) -> bool:
    with transaction(db):
        return db.execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)).rowcount > 0


def _move(db: sqlite3.Connection, tenant: str | None, response_id: str, response: dict[str, Any]
          ) -> tuple[dict[str, Any] | None, bool]:
    query, params = "SELECT data FROM responses WHERE id = ?", [response_id]
    if tenant is not None:
        query, params = query + " AND tenant = ?", [response_id, tenant]
    with transaction(db):
        row = db.execute(query, params).fetchone()
        if row is None:
            return None, False
        current: dict[str, Any] = json.loads(row[0])
        if current["status"] not in ACTIVE_STATUSES:
            return current, False
        data = json.dumps(response)
        db.execute("UPDATE responses SET status = ?, data = ?, bytes = bytes - length(CAST(data AS BLOB)) + ? "
                   "WHERE id = ?", (response["status"], data, len(data.encode()), response_id))
    return response, True


def _select_unfinished(db: sqlite3.Connection) -> list[UnfinishedResponse]:
    marks = ", ".join("?" * len(ACTIVE_STATUSES))
    rows = db.execute(f"SELECT tenant, data, items, request FROM responses WHERE status IN ({marks})",
                      ACTIVE_STATUSES).fetchall()
    return [UnfinishedResponse(tenant, StoredResponse(json.loads(data), json.loads(items)), request)
            for tenant, data, items, request in rows]
