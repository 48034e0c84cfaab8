"""`python -m loadtest noisy-neighbour` against a real instant server with two tenants, briefly: both
phases run, every abuse reaches the server and is answered without a 5xx, and the report adds up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path

import httpx
import pytest

from loadtest.__main__ import main
from loadtest.client import served_model
from loadtest.noisy import (
    ALONE,
    NEIGHBOUR,
    Neighbour,
    NoisyConfig,
    Phase,
    build_noisy_report,
    noisy_markdown,
    run_noisy,
)
from loadtest.tenants import main as tenants_main
from loadtest.workload import load_tenants
from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.factories import wait_until

MiB = 1024 * 1024
CLIENT_TENANTS = """
[[tenants]]
id = "light"
api_key = "fl-light-load"

[[tenants]]
id = "noisy"
api_key = "fl-noisy-load"
"""
ABUSES = {"large batch", "poison batch", "big uploads", "big uploads: read", "tokenize storm",
          "heavy Responses bodies", "re-attach storm", "pins"}


@pytest.fixture(scope="module")
def tenant_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("noisy-tenants")
    client_file, server_file = folder / "client.toml", folder / "server.toml"
    client_file.write_text(CLIENT_TENANTS)
    assert tenants_main([str(client_file), str(server_file)]) == 0
    return client_file, server_file


def test_both_phases_run_and_every_abuse_is_answered_without_a_5xx(tenant_files: tuple[Path, Path]) -> None:
    server = ServerThread(instant_context(tenants_file=str(tenant_files[1]), max_body_bytes=4 * MiB,
                                          batch_poll_s=0.05, tenant_max_reattached_streams=2)).start()
    try:
        config = NoisyConfig(server.base_url, load_tenants(tenant_files[0]), phase_s=2.0, light_batch_items=3,
                             neighbour_batch_items=20, poison_lines=3, upload_bytes=256 * 1024,
                             tokenize_chars=32 * 1024, storm_workers=3, heavy_items=5000, pin_words=50)
        report = build_noisy_report(asyncio.run(run_noisy(config)))
    finally:
        server.stop()

    alone, beside = report["phases"][ALONE], report["phases"][NEIGHBOUR]
    assert alone["abuses"] == {} and set(beside["abuses"]) == ABUSES
    assert report["server_errors"] == []
    for phase in (alone, beside):
        assert phase["chats_ok"] >= 1 and phase["batch_status"] == "completed" and phase["batch_s"] > 0
        assert phase["ttft_p50_s"] is not None and phase["itl_p50_s"] is not None
    assert beside["abuses"]["heavy Responses bodies"].get("400", 0) >= 1  # far past the context
    assert beside["abuses"]["re-attach storm"].get("200", 0) >= 2  # created, then followed
    assert beside["abuses"]["poison batch"] == {"200": 2}  # uploaded, and the batch accepted
    assert set(report["ratios"]) == {"ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "batch_s"}
    assert "light beside noisy" in noisy_markdown(report)


def test_the_command_refuses_a_single_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    single = tmp_path / "one.toml"
    single.write_text('[[tenants]]\nid = "light"\napi_key = "fl-light-load"\n')
    assert main(["noisy-neighbour", "--tenants", str(single), "--out", str(tmp_path / "out")]) == 2
    assert "two tenants" in capsys.readouterr().err
    assert not (tmp_path / "out" / "report.json").exists()
    json.dumps({})  # the report is JSON when it is written (see the run above)


def test_the_re_attach_storm_cancels_its_background_response_when_it_ends(tenant_files: tuple[Path, Path]) -> None:
    """A background response outlives the run (a restart too): left running, it would run into the next
    run's alone phase. Here its steps are held, so it is still running when the storm is cancelled."""
    server, executor = stepped_server(tenant_files[1])
    database = server.context.settings.batch_db_path

    def statuses() -> list[str]:  # the neighbour's responses, as the server stored them
        with contextlib.closing(sqlite3.connect(database)) as db:
            return [status for (status,) in db.execute("SELECT status FROM responses WHERE tenant = 'noisy'")]

    async def storm_then_cancel() -> list[str]:
        config = NoisyConfig(server.base_url, load_tenants(tenant_files[0]), phase_s=60.0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            model = await served_model(http, config.neighbour)
            neighbour = Neighbour(Phase(config, http, model, NEIGHBOUR))
            storm = asyncio.create_task(neighbour.reattach())
            await wait_until(lambda: bool(neighbour.background_ids), what="the background response's id")
            assert neighbour.phase.result.abuses["re-attach storm"] == {"200": 1}
            running = statuses()
            storm.cancel()
            await asyncio.gather(storm, return_exceptions=True)
            return running

    try:
        running = asyncio.run(asyncio.wait_for(storm_then_cancel(), timeout=30))
        assert running and set(running) <= {"queued", "in_progress"}
        # The server stores the cancel from its database thread: on a busy machine a moment after the answer.
        wait_for(lambda: statuses() == ["cancelled"], timeout=30, what="the background response cancelled")
    finally:
        executor.open()
        server.stop()
