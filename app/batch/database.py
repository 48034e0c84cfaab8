"""The batch database: created private, checked at start-up, and owned by one thread.

SQLite never runs on the event loop. One thread owns the only connection and runs every read and
write in the order they were submitted; the loop awaits the result. With a single writer,
transactions never wait on each other's locks, and a long one (a 60,000-row cancel) delays other
store calls but never the loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from app.plumbing.private_dirs import make_private_dirs

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

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
    data TEXT NOT NULL,
    status TEXT NOT NULL  -- a copy of data's status, so the runner can find active batches by index
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
-- Stored responses of the Responses API (app/responses/store.py).
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,  -- a copy of data's status, so unfinished background responses are found by index
    data TEXT NOT NULL,    -- the response object
    items TEXT NOT NULL,   -- its conversation's input items (earlier turns included), canonical JSON
    request TEXT,          -- a background response's request body, to run it again after a restart
    bytes INTEGER NOT NULL DEFAULT 0  -- data, items and request together: what counts against the tenant
);
CREATE INDEX IF NOT EXISTS responses_by_status ON responses (status);
"""
# Created after the migrations: databases from before a column gain it first.
RESPONSES_BY_TENANT = "CREATE INDEX IF NOT EXISTS responses_by_tenant ON responses (tenant, status)"
# Created after the migration: databases from before the status column gain it first.
STATUS_INDEX = "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, seq)"


class StoreError(Exception):
    """The batch store cannot do its work; the message says why, for an operator."""


class DatabaseUnusable(StoreError):
    """At start-up: the database file is not a SQLite database, or it is damaged."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"the batch database {path} is unusable ({detail}); move it aside to start with an "
                         f"empty one, or restore it from a backup")
        self.path = path


class StorageFull(StoreError):
    """A write failed because the disk (or the database) is full; nothing of it was kept."""


class StorageQuotaExceeded(Exception):
    """What the tenant keeps stored would pass its quota; nothing was stored. The message says which."""


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT; anything raised inside rolls everything back."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.in_transaction:  # SQLite already rolled back after some errors (a full disk among them)
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def open_database(path: Path) -> sqlite3.Connection:
    """Open (creating if needed, readable by the owner only) and check the database."""
    make_private_dirs(path.parent)
    _create_private_file(path)
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        _check_integrity(db, path)
        db.execute("PRAGMA journal_mode=WAL")  # the -wal and -shm files take the database's mode
        db.execute("PRAGMA synchronous=FULL")  # a result acknowledged is on disk
        db.executescript(SCHEMA)
        _add_status_column(db)
        _add_response_bytes_column(db)
        db.execute(STATUS_INDEX)
        db.execute(RESPONSES_BY_TENANT)
    except BaseException:
        db.close()
        raise
    return db


def _create_private_file(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return
    os.chmod(path, 0o600)


def _check_integrity(db: sqlite3.Connection, path: Path) -> None:
    try:
        rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        raise DatabaseUnusable(path, str(exc)) from exc
    problems = [str(row[0]) for row in rows if row[0] != "ok"]
    if problems:
        raise DatabaseUnusable(path, "quick_check: " + "; ".join(problems[:3]))


def _add_status_column(db: sqlite3.Connection) -> None:
    """Databases written before the status column get it, filled from each batch's data."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(batches)")}
    if "status" in columns:
        return
    with transaction(db):
        db.execute("ALTER TABLE batches ADD COLUMN status TEXT NOT NULL DEFAULT ''")
        db.execute("UPDATE batches SET status = json_extract(data, '$.status')")


def _add_response_bytes_column(db: sqlite3.Connection) -> None:
    """Databases written before stored responses counted against their tenant get their sizes."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}
    if "bytes" in columns:
        return
    with transaction(db):
        db.execute("ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
        db.execute("UPDATE responses SET bytes = length(CAST(data AS BLOB)) + length(CAST(items AS BLOB)) "
                   "+ COALESCE(length(CAST(request AS BLOB)), 0)")


class DatabaseThread:
    """The one thread that owns the connection. `run` submits work and awaits it from the loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairlane-batch-db")
        self._db: sqlite3.Connection | None = None
        try:
            # At start-up, before the loop serves anyone: waiting here blocks nothing.
            self._executor.submit(self._open).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    def _open(self) -> None:
        self._db = open_database(self.path)

    async def run(self, work: Callable[Concatenate[sqlite3.Connection, P], T], *args: P.args,
                  **kwargs: P.kwargs) -> T:
        """work(connection, *args) on the database thread; a full disk comes back as StorageFull."""
        def call() -> T:
            return self._call(work, *args, **kwargs)

        return await asyncio.wrap_future(self._executor.submit(call))

    def _call(self, work: Callable[Concatenate[sqlite3.Connection, P], T], *args: P.args,
              **kwargs: P.kwargs) -> T:
        assert self._db is not None, "the batch database is closed"
        try:
            return work(self._db, *args, **kwargs)
        except (sqlite3.OperationalError, OSError) as exc:
            if is_disk_full(exc):
                raise StorageFull(f"the disk holding {self.path} is full: {exc}") from exc
            raise

    async def close(self) -> None:
        await self.run(_close)
        self._db = None
        self._executor.shutdown(wait=False)  # its one thread is idle now and ends by itself


def _close(db: sqlite3.Connection) -> None:
    db.close()
