"""Ending a batch (completed, cancelled, expired or failed) in one transaction, on the database thread.

One transaction writes the error lines of the items that never ran (one executemany, not one
transaction per item), assembles the output and error files inside the database, and stores the
final status with their ids. A crash at any point leaves either all of it or none of it: never an
orphan file, never a second output file. Why inside the database and not as files on disk: a file
written next to the database and registered afterwards has a crash window between the two that
only a clean-up pass could close; a row in the same transaction has none.

The files are streamed row by row into a blob of the exact size, so memory stays bounded however
many items the batch has.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.batch.database import transaction
from app.plumbing.json_lines import dumps_one_line

BLOB_CHUNK_BYTES = 1024 * 1024
# An error-file line for an item that never ran (the batch ended first), as OpenAI writes it.
UNFINISHED_LINES = """
UPDATE batch_items SET state = 'failed', result = json_object(
    'id', 'batch_req_' || lower(hex(randomblob(16))), 'custom_id', custom_id, 'response', NULL,
    'error', json_object('code', ?, 'message', ?))
WHERE batch_id = ? AND state = 'pending'
"""


@dataclass(slots=True, frozen=True)
class Ending:
    """How a batch ends."""

    status: str                     # the final status: completed, cancelled, expired or failed
    from_statuses: tuple[str, ...]  # the batch must still be in one of these, else nothing changes
    unfinished_code: str | None     # error code for items that never ran; None: there must be none left
    unfinished_message: str = ""
    error: dict[str, Any] | None = None  # an entry for the batch's `errors` list (failed batches)


COMPLETED = Ending("completed", ("in_progress",), None)
CANCELLED = Ending("cancelled", ("cancelling",), "batch_cancelled", "The batch was cancelled.")
EXPIRED = Ending("expired", ("in_progress",), "batch_expired", "The batch's completion window ran out.")


def failed(reason: str) -> Ending:
    """A batch that cannot go on (a result could not be stored): it fails once, keeping what was stored."""
    message = f"The batch failed: {reason}"
    return Ending("failed", ("in_progress", "cancelling"), "batch_failed",
                  f"{message} This request has no stored result.",
                  {"code": "batch_failed", "message": message, "param": None, "line": None})


def finish_batch(db: sqlite3.Connection, batch_id: str, ending: Ending, now: int) -> bool:
    with transaction(db):
        row = db.execute("SELECT tenant, data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return False
        tenant, batch = str(row[0]), dict(json.loads(row[1]))
        if batch["status"] not in ending.from_statuses:
            return False
        if ending.unfinished_code is None:
            if item_counts(db, batch_id)["pending"]:
                return False
        else:
            _write_unfinished(db, batch_id, ending.unfinished_code, ending.unfinished_message)
        batch["finalizing_at"] = now
        batch["output_file_id"] = _assemble_file(db, tenant, batch_id, "succeeded", "output", now)
        batch["error_file_id"] = _assemble_file(db, tenant, batch_id, "failed", "error", now)
        counts = item_counts(db, batch_id)
        batch["request_counts"] = {"total": sum(counts.values()), "completed": counts["succeeded"],
                                   "failed": counts["failed"]}
        if ending.error is not None:
            batch["errors"] = {"object": "list", "data": [ending.error]}
        batch.update({"status": ending.status, f"{ending.status}_at": now})
        write_batch(db, batch)
    return True


def item_counts(db: sqlite3.Connection, batch_id: str) -> dict[str, int]:
    rows = db.execute("SELECT state, COUNT(*) FROM batch_items WHERE batch_id = ? GROUP BY state", (batch_id,))
    return {"pending": 0, "succeeded": 0, "failed": 0, **{str(state): int(n) for state, n in rows}}


def write_batch(db: sqlite3.Connection, batch: dict[str, Any]) -> None:
    db.execute("UPDATE batches SET data = ?, status = ? WHERE id = ?",
               (json.dumps(batch), batch["status"], batch["id"]))


def insert_file_row(db: sqlite3.Connection, file_id: str, tenant: str, filename: str, purpose: str, size: int,
                    created_at: int) -> int:
    """A file row whose content is `size` zero bytes, to be filled through a blob handle; its rowid."""
    cursor = db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, zeroblob(?))",
                        (file_id, tenant, filename, purpose, size, created_at, size))
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def dump_line(line: dict[str, Any]) -> str:
    """One line of an output or error file, as stored: compact JSON, so files are plain concatenations."""
    return dumps_one_line(line).decode()  # a text holding U+2028 never splits a JSONL line


def _write_unfinished(db: sqlite3.Connection, batch_id: str, code: str, message: str) -> None:
    """Every pending item gets an error line, in OpenAI's shape, in one statement. SQLite builds the
    lines: a 60,000-item cancel then creates no Python objects (whose garbage collection would pause
    the event loop too) and runs without holding the GIL."""
    db.execute(UNFINISHED_LINES, (code, message, batch_id))


def _assemble_file(db: sqlite3.Connection, tenant: str, batch_id: str, state: str, kind: str,
                   now: int) -> str | None:
    """The `state` items' result lines, in line order, as a new file; None when there are none."""
    size, count = db.execute("SELECT COALESCE(SUM(LENGTH(CAST(result AS BLOB)) + 1), 0), COUNT(*) "
                             "FROM batch_items WHERE batch_id = ? AND state = ?", (batch_id, state)).fetchone()
    if not count:
        return None
    file_id = "file-" + uuid.uuid4().hex
    rowid = insert_file_row(db, file_id, tenant, f"{batch_id}_{kind}.jsonl", "batch_output", size, now)
    with db.blobopen("files", "content", rowid) as blob:
        for chunk in _chunks(db, batch_id, state):
            blob.write(chunk)
    return file_id


def _chunks(db: sqlite3.Connection, batch_id: str, state: str) -> Iterator[bytes]:
    buffer = bytearray()
    for (result,) in db.execute("SELECT result FROM batch_items WHERE batch_id = ? AND state = ? ORDER BY line",
                                (batch_id, state)):
        buffer += str(result).encode() + b"\n"
        if len(buffer) >= BLOB_CHUNK_BYTES:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)
