"""What one tenant or one fault must not do to the server: operator endpoints closed to tenants, a
dead engine loop failing loudly, one tenant's flood never another's 503, batch work refused before
interactive work in a filling queue, shutdown 503s that say when to come back."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.openai.routes import OpenAIRoutes
from app.serving.items import RetryLater
from scheduling.engine import Engine
from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.tenants_files import tenants_toml

ADMIN_KEY = "fl-admin-key"
KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key"}
TENANTS_TOML = tenants_toml(KEYS, admin_key=ADMIN_KEY)
OPERATOR_PATHS = ["/stats", "/metrics", "/dashboard", "/dashboard/dashboard.js"]


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return path


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "prompt": "hi", "max_tokens": 2, **fields}


async def post_as(http: httpx.AsyncClient, server: ServerThread, tenant: str) -> httpx.Response:
    return await http.post("/v1/completions", json=completion(server), headers=bearer(KEYS[tenant]))


@pytest.fixture(scope="module")
def guarded_server(tenants_file: Path) -> Iterator[ServerThread]:
    server = ServerThread(instant_context(tenants_file=str(tenants_file))).start()
    yield server
    server.stop()


@pytest.mark.parametrize("path", OPERATOR_PATHS)
def test_operator_endpoints_take_only_the_admin_key(guarded_server: ServerThread, path: str) -> None:
    url = guarded_server.base_url + path
    anonymous = httpx.get(url, timeout=10)
    tenant = httpx.get(url, headers=bearer(KEYS["alice"]), timeout=10)
    wrong = httpx.get(url, headers=bearer("fl-guess"), timeout=10)
    admin = httpx.get(url, headers=bearer(ADMIN_KEY), timeout=10)
    basic = base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()
    browser = httpx.get(url, headers={"authorization": f"Basic {basic}"}, timeout=10)

    assert anonymous.status_code == 401 and "basic" in anonymous.headers["www-authenticate"].lower()
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert wrong.status_code == 401
    assert admin.status_code == 200 and browser.status_code == 200


def test_the_dashboard_event_stream_is_guarded_too(guarded_server: ServerThread) -> None:
    url = guarded_server.base_url + "/dashboard/events"
    assert httpx.get(url, headers=bearer(KEYS["bob"]), timeout=10).status_code == 403
    with httpx.stream("GET", url, headers=bearer(ADMIN_KEY), timeout=10) as events:
        assert events.status_code == 200
        assert any(line.startswith("data: ") for line in events.iter_lines())


def test_metrics_public_opens_metrics_alone(tenants_file: Path) -> None:
    server = ServerThread(instant_context(tenants_file=str(tenants_file), metrics_public=True)).start()
    try:
        metrics = httpx.get(server.base_url + "/metrics", timeout=10)
        stats = httpx.get(server.base_url + "/stats", timeout=10)
    finally:
        server.stop()
    assert metrics.status_code == 200 and "fairlane" in metrics.text
    assert stats.status_code == 401


def test_a_dead_engine_loop_fails_requests_loudly_and_stops_the_server() -> None:
    server = ServerThread(instant_context()).start()
    engine = server.context.engine
    assert isinstance(engine, Engine)
    original = engine.scheduler.update
    calls = [0]

    def update(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > 5:
            raise RuntimeError("injected update failure")
        return original(*args)

    engine.scheduler.update = update  # type: ignore[method-assign,assignment]
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=20,
                      json=completion(server, max_tokens=200, stream=True)) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    wait_for(lambda: not server.is_running, timeout=30, what="the server to stop by itself")

    assert lines[-1] == "data: [DONE]" and "injected update failure" in lines[-2]
    assert server.server.exit_code == 1
    health = engine.health()  # what /health answered until the server was gone
    assert not health.is_healthy and health.reason is not None and "injected update failure" in health.reason


def test_a_failed_step_answers_a_whole_response_with_the_engines_reason() -> None:
    server = ServerThread(instant_context()).start()

    def execute(plan: Any) -> Any:
        raise RuntimeError("injected step failure")

    server.context.engine.executor.execute = execute  # type: ignore[method-assign]
    try:
        answer = httpx.post(server.base_url + "/v1/completions", json=completion(server), timeout=20)
    finally:
        server.stop()

    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "the engine failed: RuntimeError"


async def test_one_tenants_flood_is_not_anothers_503(tenants_file: Path) -> None:
    server, executor = stepped_server(tenants_file, max_queued_requests=4)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            flood = [asyncio.create_task(post_as(http, server, "alice")) for _ in range(6)]
            await asyncio.to_thread(wait_for, lambda: server.engine.num_unfinished == 4, what="alice to fill it")
            light = [asyncio.create_task(post_as(http, server, "bob")) for _ in range(2)]
            await asyncio.to_thread(wait_for, lambda: server.engine.num_unfinished == 6, what="bob's requests")
            executor.open()
            flooded = await asyncio.gather(*flood)
            served = await asyncio.gather(*light)
    finally:
        executor.open()
        server.stop()
    assert sorted(r.status_code for r in flooded) == [200, 200, 200, 200, 503, 503]  # alone, the server was full
    assert [r.status_code for r in served] == [200, 200]


async def test_past_its_share_a_tenant_gets_429(tenants_file: Path) -> None:
    server, executor = stepped_server(tenants_file, max_queued_requests=4)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            first = [asyncio.create_task(post_as(http, server, t)) for t in ("bob", "alice", "alice", "alice")]
            await asyncio.to_thread(wait_for, lambda: server.engine.num_unfinished == 4, what="a full queue")
            over = await post_as(http, server, "alice")
            executor.open()
            await asyncio.gather(*first)
    finally:
        executor.open()
        server.stop()
    assert over.status_code == 429 and over.json()["error"]["code"] == "queue_share_exceeded"
    assert over.headers["retry-after"] == "1"


def chat(server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


async def test_a_filling_queue_refuses_batch_work_while_interactive_work_gets_in() -> None:
    server, executor = stepped_server(max_queued_requests=4, batch_queue_fraction=0.5)  # batch may fill 2
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=chat(server))) for _ in range(2)]
            await asyncio.to_thread(wait_for, lambda: server.engine.num_unfinished == 2, what="the batch part full")
            batch = await http.post("/v1/chat/completions", json=chat(server, service_tier="flex"))
            interactive = [asyncio.create_task(http.post("/v1/chat/completions", json=chat(server))),
                           asyncio.create_task(http.post("/v1/messages", json=chat(server)))]  # always interactive
            await asyncio.to_thread(wait_for, lambda: server.engine.num_unfinished == 4, what="interactive admitted")
            executor.open()
            served = await asyncio.gather(*held, *interactive)
    finally:
        executor.open()
        server.stop()
    error = batch.json()["error"]
    assert batch.status_code == 503 and batch.headers["retry-after"] == "1"
    assert error.keys() == {"message", "type", "param", "code"} and error["code"] == "server_overloaded"
    assert "batch-class requests may fill 2" in error["message"]
    assert [r.status_code for r in served] == [200, 200, 200, 200]


def test_shutdown_503s_carry_retry_after() -> None:
    server, executor = stepped_server(shutdown_grace_s=30)
    try:
        held = threading.Thread(target=httpx.post, args=(server.base_url + "/v1/completions",),
                                kwargs={"json": completion(server), "timeout": 30})
        held.start()
        wait_for(lambda: server.engine.num_unfinished == 1, what="a request in flight")
        server.server.request_shutdown()
        wait_for(lambda: server.context.is_draining, what="the drain to start")
        refused = httpx.post(server.base_url + "/v1/completions", json=completion(server), timeout=10)
        health = httpx.get(server.base_url + "/health", timeout=10)
        executor.open()
        held.join(timeout=30)
    finally:
        executor.open()
        server.stop()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert health.status_code == 503 and health.headers["retry-after"] == "1"


def test_batch_items_wait_for_their_tenants_tokens_per_minute(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml({"alice": KEYS["alice"]}, settings={"alice": {"tokens_per_minute": 20}}))
    server = ServerThread(instant_context(tenants_file=str(tenants))).start()
    routes = OpenAIRoutes(server.context)
    item = {"model": server.model_name, "prompt": "hello", "max_tokens": 10, "ignore_eos": True}

    def run_item() -> tuple[int, str, dict[str, Any]]:
        assert server.server.loop is not None
        work = routes.run_batch_item("alice", "/v1/completions", item)
        return asyncio.run_coroutine_threadsafe(work, server.server.loop).result(timeout=30)

    try:
        status, _, body = run_item()  # 15 of the 20 tokens
        with pytest.raises(RetryLater, match="tokens_per_minute"):
            run_item()  # the rest of the minute holds 5: it waits, it does not fail
    finally:
        server.stop()
    assert status == 200 and body["usage"]["total_tokens"] == 15
