"""Durable state of the Files and Batch APIs in SQLite (WAL): files, batches, and one row per item.

Every method is a coroutine whose SQL runs on the database thread (database.py), never on the
event loop. Exactly once: an item's result is written in the same transaction that marks it done;
a batch ends (its output and error files, its final status) in one more transaction (finish.py).
After a crash, items that were running but not written are simply run again; items already
written are never run again.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from app.batch import finish
from app.batch.database import DatabaseThread, StorageQuotaExceeded, transaction
from app.batch.disk_share import DiskShare

COPY_CHUNK_BYTES = 1024 * 1024


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
class FileQuota:
    """What one tenant may keep: files, and their bytes together, within its share of the disk."""

    max_files: int
    max_bytes: int
    disk: DiskShare | None = None


@dataclass(slots=True, frozen=True)
class ActiveBatch:
    """What the runner needs of a batch it works on."""

    id: str
    tenant: str
    status: str
    endpoint: str
    expires_at: int


@dataclass(slots=True, frozen=True)
class PendingItem:
    batch_id: str
    line: int
    custom_id: str
    body: dict[str, Any]


class BatchStore:
    """All SQL lives here and in finish.py; all of it runs on one database thread."""

    def __init__(self, path: str | Path) -> None:
        """Opens and checks the database; raises DatabaseUnusable if it is not a sound SQLite file."""
        self._db = DatabaseThread(Path(path))

    async def close(self) -> None:
        await self._db.close()

    # ---- files ----------------------------------------------------------------------------

    async def add_file(self, tenant: str, filename: str, purpose: str, source: IO[bytes],
                       quota: FileQuota | None = None) -> StoredFile:
        """Store source's content from where it stands to its end, copied in chunks; StorageQuotaExceeded
        when the tenant's files would pass its quota (checked in the same transaction as the insert)."""
        return await self._db.run(_insert_file, tenant, filename, purpose, source, quota)

    async def file_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        """The file's content in chunks of COPY_CHUNK_BYTES, each read on the database thread when the
        consumer asks for it, so a large file is never whole in memory; None: no such file of the tenant."""
        found = await self._db.run(_file_rowid, tenant, file_id)
        if found is None:
            return None
        rowid, size = found

        async def chunks() -> AsyncIterator[bytes]:
            for offset in range(0, size, COPY_CHUNK_BYTES):
                chunk = await self._db.run(_read_chunk, rowid, offset, min(COPY_CHUNK_BYTES, size - offset))
                if chunk is None:  # deleted while being read: the response ends short, as the file did
                    return
                yield chunk

        return chunks()

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        return await self._db.run(_select_file, tenant, file_id)

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        return await self._db.run(_select_content, tenant, file_id)

    async def list_files(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        return await self._db.run(_select_files, tenant, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return await self._db.run(_delete_file, tenant, file_id)

    # ---- batches --------------------------------------------------------------------------

    async def add_batch(self, tenant: str, batch: dict[str, Any], items: list[tuple[str, str]]) -> None:
        """Store a new batch and its items (custom_id, body as JSON text), all in one transaction."""
        await self._db.run(_insert_batch, tenant, batch, items)

    async def get_batch(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        return await self._db.run(_select_batch, tenant, batch_id)

    async def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        return await self._db.run(_select_batches, tenant, after, limit)

    async def active_batches(self, statuses: tuple[str, ...]) -> list[ActiveBatch]:
        """Batches in these statuses only (by index), oldest first: not every batch ever stored."""
        return await self._db.run(_select_active, statuses)

    async def move_batch(self, tenant: str | None, batch_id: str, from_statuses: tuple[str, ...], status: str,
                         now: int) -> tuple[dict[str, Any] | None, bool]:
        """Move a batch to status (stamping `<status>_at`) only if it is still in from_statuses.
        Returns the batch as it is afterwards (None: no such batch) and whether it moved."""
        return await self._db.run(_move_batch, tenant, batch_id, from_statuses, status, now)

    async def finish_batch(self, batch_id: str, ending: finish.Ending, now: int) -> bool:
        """End a batch in one transaction (see finish.py); False if it was not in a state to end so."""
        return await self._db.run(finish.finish_batch, batch_id, ending, now)

    # ---- items ----------------------------------------------------------------------------

    async def pending_items(self, batch_id: str, skip_lines: set[int], limit: int) -> list[PendingItem]:
        return await self._db.run(_select_pending, batch_id, skip_lines, limit)

    async def record_result(self, batch_id: str, line: int, succeeded: bool, result: dict[str, Any]) -> bool:
        """Write an item's result once; False if it was already written (never written twice)."""
        return await self._db.run(_update_result, batch_id, line, succeeded, result)

    async def item_counts(self, batch_id: str) -> dict[str, int]:
        return await self._db.run(finish.item_counts, batch_id)

    async def count_batches(self) -> dict[tuple[str, str], int]:
        """Batches by (tenant, status), every batch ever stored: what /metrics reports."""
        return await self._db.run(_count_batches)


# ---- on the database thread ---------------------------------------------------------------

FILE_COLUMNS = "id, tenant, filename, purpose, bytes, created_at"


def _insert_file(db: sqlite3.Connection, tenant: str, filename: str, purpose: str,
                 source: IO[bytes], quota: FileQuota | None) -> StoredFile:
    start = source.tell()
    size = source.seek(0, os.SEEK_END) - start
    source.seek(start)
    stored = StoredFile("file-" + uuid.uuid4().hex, tenant, filename, purpose, size, int(time.time()))
    with transaction(db):
        if quota is not None:
            _check_quota(db, tenant, size, quota)
        rowid = finish.insert_file_row(db, stored.id, tenant, filename, purpose, size, stored.created_at)
        with db.blobopen("files", "content", rowid) as blob:
            while chunk := source.read(min(COPY_CHUNK_BYTES, size - blob.tell())):
                blob.write(chunk)
    return stored


def _check_quota(db: sqlite3.Connection, tenant: str, size: int, quota: FileQuota) -> None:
    count, stored_bytes = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?",
                                     (tenant,)).fetchone()
    if count + 1 > quota.max_files:
        raise StorageQuotaExceeded(f"this tenant already keeps {count} files, its limit; delete some first")
    if stored_bytes + size > quota.max_bytes:
        raise StorageQuotaExceeded(f"this file ({size} bytes) would bring this tenant's stored files to "
                                   f"{stored_bytes + size} bytes, over its limit of {quota.max_bytes}; "
                                   "delete some first")
    if quota.disk is not None:
        all_bytes = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
        quota.disk.check(stored_bytes, all_bytes, size)


def _file_rowid(db: sqlite3.Connection, tenant: str, file_id: str) -> tuple[int, int] | None:
    row = db.execute("SELECT rowid, bytes FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
    return (int(row[0]), int(row[1])) if row else None


def _read_chunk(db: sqlite3.Connection, rowid: int, offset: int, length: int) -> bytes | None:
    try:
        with db.blobopen("files", "content", rowid, readonly=True) as blob:
            blob.seek(offset)
            return blob.read(length)
    except sqlite3.OperationalError:  # the row is gone
        return None


def _select_file(db: sqlite3.Connection, tenant: str, file_id: str) -> StoredFile | None:
    row = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
    return StoredFile(*row) if row else None


def _select_content(db: sqlite3.Connection, tenant: str, file_id: str) -> bytes | None:
    row = db.execute("SELECT content FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
    return bytes(row[0]) if row else None


def _select_files(db: sqlite3.Connection, tenant: str, purpose: str | None) -> list[StoredFile]:
    query, params = f"SELECT {FILE_COLUMNS} FROM files WHERE tenant = ?", [tenant]
    if purpose is not None:
        query, params = query + " AND purpose = ?", [tenant, purpose]
    return [StoredFile(*row) for row in db.execute(query + " ORDER BY created_at DESC, id", params)]


def _delete_file(db: sqlite3.Connection, tenant: str, file_id: str) -> bool:
    with transaction(db):
        return db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount > 0


def _insert_batch(db: sqlite3.Connection, tenant: str, batch: dict[str, Any], items: list[tuple[str, str]]) -> None:
    with transaction(db):
        seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
        db.execute("INSERT INTO batches (id, tenant, seq, data, status) VALUES (?, ?, ?, ?, ?)",
                   (batch["id"], tenant, seq, json.dumps(batch), batch["status"]))
        db.executemany("INSERT INTO batch_items VALUES (?, ?, ?, ?, 'pending', NULL)",
                       ((batch["id"], i, cid, body) for i, (cid, body) in enumerate(items)))


def _select_batch(db: sqlite3.Connection, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
    query, params = "SELECT data FROM batches WHERE id = ?", [batch_id]
    if tenant is not None:
        query, params = query + " AND tenant = ?", [batch_id, tenant]
    row = db.execute(query, params).fetchone()
    return dict(json.loads(row[0])) if row else None


def _select_batches(db: sqlite3.Connection, tenant: str, after: str | None,
                    limit: int) -> tuple[list[dict[str, Any]], bool]:
    cursor_seq = None
    if after is not None:
        row = db.execute("SELECT seq FROM batches WHERE id = ? AND tenant = ?", (after, tenant)).fetchone()
        cursor_seq = row[0] if row else None
    rows = db.execute("SELECT data FROM batches WHERE tenant = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                      (tenant, cursor_seq if cursor_seq is not None else 2**62, limit + 1)).fetchall()
    return [dict(json.loads(r[0])) for r in rows[:limit]], len(rows) > limit


def _select_active(db: sqlite3.Connection, statuses: tuple[str, ...]) -> list[ActiveBatch]:
    marks = ", ".join("?" * len(statuses))
    rows = db.execute(f"SELECT tenant, data FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)
    active = []
    for tenant, data in rows:
        batch = json.loads(data)
        active.append(ActiveBatch(batch["id"], tenant, batch["status"], batch["endpoint"], batch["expires_at"]))
    return active


def _move_batch(db: sqlite3.Connection, tenant: str | None, batch_id: str, from_statuses: tuple[str, ...],
                status: str, now: int) -> tuple[dict[str, Any] | None, bool]:
    with transaction(db):
        batch = _select_batch(db, tenant, batch_id)
        if batch is None or batch["status"] not in from_statuses:
            return batch, False
        batch.update({"status": status, f"{status}_at": now})
        finish.write_batch(db, batch)
    return batch, True


def _select_pending(db: sqlite3.Connection, batch_id: str, skip_lines: set[int], limit: int) -> list[PendingItem]:
    rows = db.execute("SELECT line, custom_id, body FROM batch_items WHERE batch_id = ? AND state = 'pending' "
                      "ORDER BY line LIMIT ?", (batch_id, limit + len(skip_lines))).fetchall()
    items = [PendingItem(batch_id, line, cid, json.loads(body)) for line, cid, body in rows if line not in skip_lines]
    return items[:limit]


def _update_result(db: sqlite3.Connection, batch_id: str, line: int, succeeded: bool, result: dict[str, Any]) -> bool:
    with transaction(db):
        return db.execute(
            "UPDATE batch_items SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
            ("succeeded" if succeeded else "failed", finish.dump_line(result), batch_id, line)).rowcount > 0


def _count_batches(db: sqlite3.Connection) -> dict[tuple[str, str], int]:
    rows = db.execute("SELECT tenant, status, COUNT(*) FROM batches GROUP BY tenant, status")
    return {(tenant, status): count for tenant, status, count in rows}
