"""Durable state of the Files and Batch APIs in SQLite (WAL): files, batches, and one row per item.

Exactly once: an item's result is written in the same transaction that marks it done, and the
output and error files are assembled from those rows at finalization. After a crash, items that
were running but not written are simply run again; items already written are never run again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE TABLE IF NOT EXISTS batch_items (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,  -- pending, succeeded, failed
    result TEXT,          -- the output or error line, once written
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS pending_items ON batch_items (batch_id, state, line);
"""


@dataclass(slots=True, frozen=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


@dataclass(slots=True, frozen=True)
class PendingItem:
    batch_id: str
    line: int
    custom_id: str
    body: dict[str, Any]


class BatchStore:
    """All SQL lives here. Safe to call from the event loop thread and worker threads."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:  # pragmas and the schema script manage their own transactions
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=FULL")  # a result acknowledged is on disk
            self._connection.executescript(SCHEMA)

    def close(self) -> None:
        self._connection.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._connection
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    # ---- files ----------------------------------------------------------------------------

    def add_file(self, tenant: str, filename: str, purpose: str, content: bytes) -> StoredFile:
        stored = StoredFile("file-" + uuid.uuid4().hex, tenant, filename, purpose, len(content), int(time.time()))
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (stored.id, tenant, filename, purpose, stored.bytes, stored.created_at, content))
        return stored

    def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        with self._lock:
            row = self._connection.execute(
                "SELECT id, tenant, filename, purpose, bytes, created_at FROM files WHERE id = ? AND tenant = ?",
                (file_id, tenant)).fetchone()
        return StoredFile(*row) if row else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        with self._lock:
            row = self._connection.execute("SELECT content FROM files WHERE id = ? AND tenant = ?",
                                           (file_id, tenant)).fetchone()
        return bytes(row[0]) if row else None

    def list_files(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        query = "SELECT id, tenant, filename, purpose, bytes, created_at FROM files WHERE tenant = ?"
        params = [tenant]
        if purpose is not None:
            query, params = query + " AND purpose = ?", [tenant, purpose]
        with self._lock:
            rows = self._connection.execute(query + " ORDER BY created_at DESC, id", params).fetchall()
        return [StoredFile(*row) for row in rows]

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount > 0

    # ---- batches --------------------------------------------------------------------------

    def add_batch(self, tenant: str, batch: dict[str, Any], items: list[tuple[str, dict[str, Any]]]) -> None:
        """Store a new batch and its items (custom_id, body), all in one transaction."""
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?)", (batch["id"], tenant, seq, json.dumps(batch)))
            db.executemany("INSERT INTO batch_items VALUES (?, ?, ?, ?, 'pending', NULL)",
                           [(batch["id"], i, cid, json.dumps(body)) for i, (cid, body) in enumerate(items)])

    def get_batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        query, params = "SELECT data FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            query, params = query + " AND tenant = ?", [batch_id, tenant]
        with self._lock:
            row = self._connection.execute(query, params).fetchone()
        return dict(json.loads(row[0])) if row else None

    def batch_tenant(self, batch_id: str) -> str | None:
        with self._lock:
            row = self._connection.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row[0]) if row else None

    def save_batch(self, batch: dict[str, Any]) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batches SET data = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        with self._lock:
            cursor_seq = None
            if after is not None:
                row = self._connection.execute("SELECT seq FROM batches WHERE id = ? AND tenant = ?",
                                               (after, tenant)).fetchone()
                cursor_seq = row[0] if row else None
            rows = self._connection.execute(
                "SELECT data FROM batches WHERE tenant = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                (tenant, cursor_seq if cursor_seq is not None else 2**62, limit + 1)).fetchall()
        return [dict(json.loads(r[0])) for r in rows[:limit]], len(rows) > limit

    def batches_with_status(self, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._connection.execute("SELECT data FROM batches ORDER BY seq").fetchall()
        batches = [dict(json.loads(r[0])) for r in rows]
        return [b for b in batches if b["status"] in statuses]

    # ---- items ----------------------------------------------------------------------------

    def pending_items(self, batch_id: str, skip_lines: set[int], limit: int) -> list[PendingItem]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT line, custom_id, body FROM batch_items WHERE batch_id = ? AND state = 'pending' "
                "ORDER BY line LIMIT ?", (batch_id, limit + len(skip_lines))).fetchall()
        items = [PendingItem(batch_id, line, cid, json.loads(body)) for line, cid, body in rows
                 if line not in skip_lines]
        return items[:limit]

    def record_result(self, batch_id: str, line: int, succeeded: bool, result: dict[str, Any]) -> bool:
        """Write an item's result once; False if it was already written (never written twice)."""
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE batch_items SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
                ("succeeded" if succeeded else "failed", json.dumps(result), batch_id, line)).rowcount
        return changed > 0

    def item_counts(self, batch_id: str) -> dict[str, int]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT state, COUNT(*) FROM batch_items WHERE batch_id = ? GROUP BY state", (batch_id,)).fetchall()
        counts = {"pending": 0, "succeeded": 0, "failed": 0, **{state: n for state, n in rows}}
        return counts

    def results(self, batch_id: str, state: str) -> list[str]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT result FROM batch_items WHERE batch_id = ? AND state = ? ORDER BY line",
                (batch_id, state)).fetchall()
        return [str(r[0]) for r in rows]

    def pending_custom_ids(self, batch_id: str) -> list[tuple[int, str]]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT line, custom_id FROM batch_items WHERE batch_id = ? AND state = 'pending' ORDER BY line",
                (batch_id,)).fetchall()
        return [(int(line), str(cid)) for line, cid in rows]
