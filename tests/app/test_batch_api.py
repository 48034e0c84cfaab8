"""The Files and Batch APIs through the official openai client, on real servers and real SQLite."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.app.served_process import ServedProcess
from tests.tenants_files import tenants_toml

KEYS = {"alice": "fl-alice-batch", "bob": "fl-bob-batch", "carol": "fl-carol-batch", "dave": "fl-dave-batch"}
CAPPED = {"carol": {"max_concurrent": 1, "max_queued": 1},  # at most 2 requests in flight
          "dave": {"max_files": 2, "max_file_bytes": 4000}}


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch-tenants") / "tenants.toml"
    path.write_text(tenants_toml(KEYS, settings=CAPPED))
    return path


@pytest.fixture(scope="module")
def server(tenants_file: Path) -> Iterator[ServerThread]:
    started = ServerThread(instant_context(tenants_file=str(tenants_file), batch_poll_s=0.05)).start()
    yield started
    started.stop()


def client_for(server: ServerThread | str, tenant: str = "alice") -> openai.OpenAI:
    base = server if isinstance(server, str) else server.base_url
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS[tenant], max_retries=0, timeout=30)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def item(custom_id: str, model: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    payload = {"model": model, "max_tokens": 6, **body}
    if url == "/v1/chat/completions":
        payload.setdefault("messages", [{"role": "user", "content": f"Say {custom_id}"}])
    else:
        payload.setdefault("prompt", f"Say {custom_id}")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def completed_count(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def wait_for_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 60) -> Any:
    found: list[Any] = []

    def reached() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in statuses

    wait_for(reached, timeout=timeout, interval=0.05, what=f"batch {batch_id} to reach {statuses}")
    return found[0]


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n") if line]


def test_batch_runs_every_item_through_the_official_client(server: ServerThread) -> None:
    client = client_for(server)
    lines = [item(f"req-{i}", server.model_name) for i in range(12)]
    lines.append(item("bad-temp", server.model_name, temperature=5))  # valid JSON, fails when run
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    assert file_id in [f.id for f in client.files.list()]

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    done = wait_for_status(client, batch.id, ("completed",))

    assert done.request_counts.total == 13
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 1)
    assert done.completed_at is not None and done.in_progress_at is not None
    outputs = output_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"req-{i}" for i in range(12))
    first = outputs[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion"
    errors = output_lines(client, done.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad-temp", 400)]
    batch_requests = [r for r in server.engine.submitted if r.request_id.startswith("chatcmpl-")]
    assert batch_requests and all(r.priority.value == "batch" and r.tenant_id == "alice" for r in batch_requests)


def test_a_line_that_can_never_be_admitted_fails_alone_at_once(server: ServerThread) -> None:
    """n = 3 needs 3 requests in flight where carol may have 2: a 400 error line, not a retry every second
    until the window expires."""
    client = client_for(server, "carol")
    lines = [item(f"ok-{i}", server.model_name) for i in range(3)] + [item("too-many", server.model_name, n=3)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for_status(client, batch.id, ("completed",), timeout=30)
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    errors = output_lines(client, done.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("too-many", 400)]
    assert errors[0]["response"]["body"]["error"]["code"] == "too_many_generations"
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        client.chat.completions.create(model=server.model_name, n=3, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])


def test_storage_limits_answer_429_and_keep_what_is_stored(server: ServerThread) -> None:
    client = client_for(server, "dave")

    def upload_bytes(size: int) -> str:
        return client.files.create(file=("f.jsonl", io.BytesIO(b"x" * size)), purpose="batch").id

    first, second = upload_bytes(1000), upload_bytes(1000)
    with pytest.raises(openai.RateLimitError) as too_many:  # a third file: over max_files
        upload_bytes(10)
    assert too_many.value.code == "storage_limit_exceeded" and "2 files" in str(too_many.value)
    client.files.delete(second)
    with pytest.raises(openai.RateLimitError, match="over its limit of 4000"):  # 1000 + 3500 bytes
        upload_bytes(3500)
    third = upload_bytes(2500)
    assert client.files.content(first).content == b"x" * 1000  # nothing stored was lost
    assert sorted(f.id for f in client.files.list()) == sorted([first, third])


def test_a_tenant_past_its_share_of_the_disk_gets_507_and_the_others_still_upload(tenants_file: Path,
                                                                                   tmp_path: Path) -> None:
    """The disk's free space beyond the reserve (with what the tenants store) is split among the four
    tenants: 200 MiB shared, about 50 MiB each. alice uploads 8 MiB files until she gets 507, for her
    alone; bob's file still goes in, and alice's first file is still whole. (Other processes' writes, and
    this server's own spooled uploads and database log, move the disk's free space meanwhile: the test
    counts on tens of MiB of margin, not on exact shares.)"""
    mib = 1024 * 1024
    reserve = shutil.disk_usage(tmp_path).free - 200 * mib
    server = ServerThread(instant_context(tenants_file=str(tenants_file), batch_db_path=str(tmp_path / "files.db"),
                                          storage_reserve_bytes=reserve, tenant_file_bytes_per_s=1024 * mib)).start()
    try:
        with client_for(server, "alice") as alice, client_for(server, "bob") as bob:
            stored: list[str] = []
            for number in range(20):
                try:
                    stored.append(alice.files.create(file=(f"{number}.jsonl", io.BytesIO(b"a" * 8 * mib)),
                                                     purpose="batch").id)
                except openai.APIStatusError as exc:
                    assert exc.status_code == 507, exc
                    assert exc.code == "insufficient_storage" and "share of the server's disk" in str(exc)
                    break
            assert 3 <= len(stored) < 20  # about her share's worth, then 507
            assert bob.files.create(file=("b.jsonl", io.BytesIO(b"b" * 8 * mib)), purpose="batch").bytes == 8 * mib
            assert alice.files.content(stored[0]).content == b"a" * 8 * mib
            assert {f.id for f in alice.files.list()} == set(stored)
    finally:
        server.stop()


def test_file_content_comes_back_whole_in_chunks(server: ServerThread) -> None:
    """Several copy chunks' worth, streamed from the database: the same bytes, in order."""
    client = client_for(server, "bob")
    content = os.urandom(3 * 1024 * 1024 + 17)
    file_id = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch").id
    assert client.files.content(file_id).content == content
    client.files.delete(file_id)


def test_batches_list_pages_newest_first(server: ServerThread) -> None:
    client = client_for(server, "bob")
    file_id = upload(client, [item("only", server.model_name, url="/v1/completions")])
    created = [client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                     completion_window="24h").id for _ in range(3)]
    first_page = client.batches.list(limit=2)
    assert [b.id for b in first_page.data] == created[::-1][:2] and first_page.has_more
    second_page = client.batches.list(limit=2, after=first_page.data[-1].id)
    assert [b.id for b in second_page.data] == created[:1] and not second_page.has_more


@pytest.mark.parametrize(("line", "code"), [
    ("{not json", "invalid_json_line"),
    ("duplicate", "duplicate_custom_id"),
    ("other-endpoint", "mismatched_endpoint"),
    ("unknown-model", "model_not_found"),
])
def test_invalid_input_fails_the_batch_naming_the_line(server: ServerThread, line: str, code: str) -> None:
    client = client_for(server)
    good = json.dumps(item("a", server.model_name))
    bad = {
        "{not json": line,
        "duplicate": good,
        "other-endpoint": json.dumps(item("b", server.model_name, url="/v1/completions")),
        "unknown-model": json.dumps(item("b", "no-such-model")),
    }[line]
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(f"{good}\n{bad}\n".encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.code, e.line) for e in batch.errors.data or []] == [(code, 2)]


def test_another_tenants_files_and_batches_answer_404(server: ServerThread) -> None:
    alice, bob = client_for(server, "alice"), client_for(server, "bob")
    file_id = upload(alice, [item("x", server.model_name)])
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in bob.files.list()]
    assert alice.files.delete(file_id).deleted


def test_upload_over_the_size_limit_gets_413(tenants_file: Path) -> None:
    server = ServerThread(instant_context(tenants_file=str(tenants_file), max_upload_bytes=4096)).start()
    try:
        response = httpx.post(f"{server.base_url}/v1/files", headers={"authorization": f"Bearer {KEYS['alice']}"},
                              files={"file": ("big.jsonl", b"x" * 10_000)}, data={"purpose": "batch"}, timeout=10)
    finally:
        server.stop()
    assert response.status_code == 413


def test_cancel_ends_the_batch_keeping_finished_results(tenants_file: Path) -> None:
    server, executor = stepped_server(tenants_file, batch_poll_s=0.05, batch_max_in_flight=2)
    try:
        client = client_for(server)
        lines = [item(f"c{i}", server.model_name) for i in range(30)]
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        executor.step_until(lambda: completed_count(client, batch.id) >= 2, what="two items to finish")
        assert client.batches.cancel(batch.id).status == "cancelling"  # the running items' steps are held
        done = wait_for_status(client, batch.id, ("cancelled",))
        outputs, errors = output_lines(client, done.output_file_id), output_lines(client, done.error_file_id)
        executor.open()
        wait_for(lambda: server.stats()["kv_blocks_in_use"] == 0, what="the cancelled items' blocks to be freed")
    finally:
        executor.open()
        server.stop()
    assert len(outputs) >= 2 and len(outputs) + len(errors) == 30
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_an_expired_window_ends_the_batch_as_expired(tenants_file: Path) -> None:
    server, executor = stepped_server(tenants_file, batch_poll_s=0.05, batch_max_in_flight=1, batch_window_s=1)
    try:
        client = client_for(server)
        lines = [item(f"e{i}", server.model_name) for i in range(20)]
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        # No step runs: the item in the engine is held there and the others wait their turn, however
        # fast the machine, until the window is over.
        done = wait_for_status(client, batch.id, ("expired",), timeout=30)
        outputs, errors = output_lines(client, done.output_file_id), output_lines(client, done.error_file_id)
    finally:
        executor.open()
        server.stop()
    assert done.expired_at is not None
    assert (len(outputs), len(errors)) == (0, 20)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


@pytest.fixture
def database(tmp_path: Path) -> Path:
    return tmp_path / "batches.db"


def start_server_process(database: Path, tenants_file: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "FAIRLANE_BATCH_DB_PATH": str(database), "FAIRLANE_TENANTS_FILE": str(tenants_file),
           "FAIRLANE_BATCH_POLL_S": "0.05", "FAIRLANE_BATCH_MAX_IN_FLIGHT": "4"}
    served = ServedProcess(env).wait_ready()
    return served.process, served.base_url


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_completes_every_item_exactly_once(database: Path, tenants_file: Path
                                                                         ) -> None:
    process, base_url = start_server_process(database, tenants_file)
    try:
        client = client_for(base_url)
        lines = [item(f"k{i}", "builtin:tiny", max_tokens=24, ignore_eos=True) for i in range(40)]
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(lambda: completed_count(client, batch.id) >= 8, timeout=60,
                 what="some items to finish before the kill")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    process, base_url = start_server_process(database, tenants_file)
    try:
        client = client_for(base_url)
        done = wait_for_status(client, batch.id, ("completed",), timeout=120)
        outputs = output_lines(client, done.output_file_id)
        errors = output_lines(client, done.error_file_id)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    custom_ids = [line["custom_id"] for line in outputs + errors]
    assert sorted(custom_ids) == sorted(f"k{i}" for i in range(40))  # each exactly once
    assert not errors and done.request_counts.completed == 40
