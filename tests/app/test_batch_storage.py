"""Storage faults of the Batch and Files store, on real SQLite files: a damaged database stops start-up,
the files are private, a full disk answers 507 and fails a batch once, and ending a batch is one
transaction even when the process dies in the middle of it."""

from __future__ import annotations

import errno
import io
import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.batch import finish
from app.batch import store as store_module
from app.batch.database import DatabaseUnusable
from app.batch.store import BatchStore
from tests.app.conftest import ServerThread, instant_context
from tests.app.served_process import FAIRLANE
from tests.app.test_batch_api import (
    client_for,
    item,
    output_lines,
    tenants_file,
    upload,
    wait_for_status,
)

__all__ = ["tenants_file"]  # a fixture, imported to be used here

DISK_FULL = sqlite3.OperationalError("database or disk is full")
REPO = Path(__file__).resolve().parents[2]


def make_batch(batch_id: str = "batch_test", status: str = "validating") -> dict[str, Any]:
    return {"id": batch_id, "object": "batch", "status": status, "endpoint": "/v1/chat/completions",
            "expires_at": 2**40, "errors": None, "output_file_id": None, "error_file_id": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}}


async def real_database(path: Path, num_items: int = 2_000) -> None:
    """A database with files and a batch in it, large enough to span many pages."""
    store = BatchStore(path)
    for _ in range(8):
        await store.add_file("acme", "in.jsonl", "batch", io.BytesIO(os.urandom(20_000)))
    await store.add_batch("acme", make_batch(), [(f"c{i}", '{"model": "m"}') for i in range(num_items)])
    await store.close()


# ---- start-up ---------------------------------------------------------------------------------


def test_a_file_of_random_bytes_stops_start_up_naming_the_path(tmp_path: Path) -> None:
    database = tmp_path / "batches.db"
    database.write_bytes(os.urandom(8192))

    with pytest.raises(DatabaseUnusable, match="not a database") as raised:
        ServerThread(instant_context(batch_db_path=str(database)))
    assert str(database) in str(raised.value)


async def test_a_truncated_database_stops_start_up_naming_the_path(tmp_path: Path) -> None:
    database = tmp_path / "batches.db"
    await real_database(database)
    content = database.read_bytes()
    database.write_bytes(content[: len(content) // 2])

    with pytest.raises(DatabaseUnusable, match="malformed") as raised:
        ServerThread(instant_context(batch_db_path=str(database)))
    assert str(database) in str(raised.value)


@pytest.mark.slow
def test_fairlane_serve_exits_non_zero_on_a_corrupt_database(tmp_path: Path) -> None:
    database = tmp_path / "batches.db"
    database.write_bytes(os.urandom(8192))
    env = {**os.environ, "FAIRLANE_BATCH_DB_PATH": str(database)}

    finished = subprocess.run([str(FAIRLANE), "serve", "--model", "builtin:tiny", "--port", "0"], env=env,
                              capture_output=True, text=True, timeout=120)

    assert finished.returncode != 0
    assert str(database) in finished.stderr and "unusable" in finished.stderr


async def test_the_database_and_its_directory_are_private(tmp_path: Path) -> None:
    database = tmp_path / "data" / "fairlane" / "batches.db"
    await real_database(database, num_items=10)
    store = BatchStore(database)  # open again: the WAL file exists while a connection is open
    try:
        wal = Path(f"{database}-wal")
        modes = {path: stat.S_IMODE(path.stat().st_mode) for path in (database, wal)}
        assert modes == {database: 0o600, wal: 0o600}
        assert stat.S_IMODE(database.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(database.parent.parent.stat().st_mode) == 0o700
    finally:
        await store.close()


async def test_a_database_from_before_the_status_column_is_migrated(tmp_path: Path) -> None:
    database = tmp_path / "batches.db"
    old = sqlite3.connect(database)
    old.executescript("CREATE TABLE batches (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, seq INTEGER NOT NULL, "
                      "data TEXT NOT NULL);")
    old.execute("INSERT INTO batches VALUES ('b1', 'acme', 1, ?)", (json.dumps(make_batch("b1", "in_progress")),))
    old.commit()
    old.close()

    store = BatchStore(database)
    try:
        assert [b.id for b in await store.active_batches(("in_progress",))] == ["b1"]
    finally:
        await store.close()


# ---- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def server(tenants_file: Path) -> Iterator[ServerThread]:
    started = ServerThread(instant_context(tenants_file=str(tenants_file), batch_poll_s=0.05,
                                           batch_max_in_flight=1)).start()
    yield started
    started.stop()


def raising(exc: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc
    return fail


@pytest.mark.parametrize("fault", [DISK_FULL, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["sqlite-full", "enospc"])
def test_an_upload_on_a_full_disk_answers_507(server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                                              fault: BaseException) -> None:
    client = client_for(server)
    monkeypatch.setattr(store_module, "_insert_file", raising(fault))

    with pytest.raises(openai.APIStatusError) as raised:
        upload(client, [item("a", server.model_name)])

    assert raised.value.status_code == 507
    error = raised.value.response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
    assert "storage is full" in error["message"]
    monkeypatch.undo()
    assert client.files.list().data == []  # nothing half-stored


def batch_submissions(server: ServerThread) -> int:
    return sum(1 for r in server.engine.submitted if r.priority.value == "batch")


def test_a_result_that_cannot_be_stored_fails_the_batch_once(server: ServerThread,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_for(server)
    monkeypatch.setattr(store_module, "_update_result", raising(DISK_FULL))
    batch = client.batches.create(input_file_id=upload(client, [item(f"f{i}", server.model_name) for i in range(5)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")

    failed = wait_for_status(client, batch.id, ("failed",), timeout=30)
    monkeypatch.undo()

    assert failed.errors is not None and failed.errors.data is not None
    assert failed.errors.data[0].code == "batch_failed" and "could not be stored" in (failed.errors.data[0].message
                                                                                     or "")
    assert failed.request_counts is not None and (failed.request_counts.total, failed.request_counts.failed) == (5, 5)
    assert [e["error"]["code"] for e in output_lines(client, failed.error_file_id)] == ["batch_failed"] * 5
    assert batch_submissions(server) == 1  # the one item whose result was lost ran once; the rest never ran
    # The runner keeps running (a later batch completes), and never goes back to the failed one.
    later = client.batches.create(input_file_id=upload(client, [item(f"g{i}", server.model_name) for i in range(2)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for_status(client, later.id, ("completed",), timeout=30).request_counts.completed == 2
    assert batch_submissions(server) == 1 + 2
    assert client.batches.retrieve(batch.id).status == "failed"


# ---- ending a batch is one transaction ---------------------------------------------------------

CRASH_WHILE_FINISHING = textwrap.dedent("""
    import asyncio, os, sys
    from app.batch import finish
    from app.batch.store import BatchStore

    def crash(*args, **kwargs):
        os._exit(3)  # the process dies after the files were written, before the status is

    finish.write_batch = crash
    store = BatchStore(sys.argv[1])
    asyncio.run(store.finish_batch(sys.argv[2], finish.COMPLETED, 1000))
""")


async def finished_store(database: Path) -> str:
    """A batch whose three items all have results: the next step is to finish it."""
    store = BatchStore(database)
    batch = make_batch()
    await store.add_batch("acme", batch, [(f"c{i}", '{"model": "m"}') for i in range(3)])
    await store.move_batch(None, batch["id"], ("validating",), "in_progress", 900)
    for line in range(3):
        await store.record_result(batch["id"], line, line != 1, {"custom_id": f"c{line}", "line": line})
    await store.close()
    return str(batch["id"])


async def test_a_crash_while_finishing_leaves_no_file_and_a_retry_makes_exactly_one(tmp_path: Path) -> None:
    database = tmp_path / "batches.db"
    batch_id = await finished_store(database)

    crashed = subprocess.run([sys.executable, "-c", CRASH_WHILE_FINISHING, str(database), batch_id], cwd=REPO,
                             capture_output=True, timeout=60)
    assert crashed.returncode == 3, crashed.stderr

    store = BatchStore(database)
    try:
        assert await store.list_files("acme", "batch_output") == []
        unfinished = await store.get_batch("acme", batch_id)
        assert unfinished is not None and unfinished["status"] == "in_progress"
        assert unfinished["output_file_id"] is None

        assert await store.finish_batch(batch_id, finish.COMPLETED, 1001)
        assert not await store.finish_batch(batch_id, finish.COMPLETED, 1002)  # a second try changes nothing
        done = await store.get_batch("acme", batch_id)
        files = await store.list_files("acme", "batch_output")
        assert done is not None and done["status"] == "completed"
        assert sorted(f.id for f in files) == sorted([done["output_file_id"], done["error_file_id"]])
        output = await store.file_content("acme", done["output_file_id"])
        assert output is not None and output.splitlines() == [
            b'{"custom_id":"c0","line":0}', b'{"custom_id":"c2","line":2}']
    finally:
        await store.close()


def test_a_generated_text_with_unicode_line_breaks_stays_on_one_line() -> None:
    """A model may generate U+0085, U+2028 or U+2029, which JSON leaves raw but `str.splitlines` and other
    readers take as line ends: the stored line escapes them, and reads back to the same text."""
    text = "a\u0085b\u2028c\u2029d\ne"
    line = finish.dump_line({"custom_id": "item-0", "response": {"body": {"text": text}}})
    assert len(line.splitlines()) == 1
    assert json.loads(line)["response"]["body"]["text"] == text
