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

from app.batch.database import DatabaseThread, transaction
from app.responses.objects import ACTIVE_STATUSES


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object
    items: list[dict[str, Any]]  # the conversation's input items, canonical (app/responses/translate.py)
    request: str | None = None  # a background response's request body (JSON); None for the others


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

    async def add(self, tenant: str, response: dict[str, Any], items: list[dict[str, Any]],
                  request: str | None = None) -> None:
        """Store a response; a background one with its request body (JSON), to run it after a restart."""
        await self._db.run(_insert, tenant, response, items, request)

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
            request: str | None) -> None:
    with transaction(db):
        db.execute("INSERT INTO responses (id, tenant, status, data, items, request) VALUES (?, ?, ?, ?, ?, ?)",
                   (response["id"], tenant, response["status"], json.dumps(response), json.dumps(items), request))


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
        db.execute("UPDATE responses SET status = ?, data = ? WHERE id = ?",
                   (response["status"], json.dumps(response), response_id))
    return response, True


def _select_unfinished(db: sqlite3.Connection) -> list[UnfinishedResponse]:
    marks = ", ".join("?" * len(ACTIVE_STATUSES))
    rows = db.execute(f"SELECT tenant, data, items, request FROM responses WHERE status IN ({marks})",
                      ACTIVE_STATUSES).fetchall()
    return [UnfinishedResponse(tenant, StoredResponse(json.loads(data), json.loads(items)), request)
            for tenant, data, items, request in rows]
