"""A TTFT deadline reaches the engine request: from the request's `metadata.ttft_deadline_ms`, else from its
tenant's `ttft_target_ms` for interactive work; a malformed one is a 400 in OpenAI's shape. A tenant's
`itl_target_ms` reaches its interactive requests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scheduling.request import Request as EngineRequest
from tests.app.conftest import ServerThread, instant_context
from tests.tenants_files import tenants_toml

KEYS = {"timely": "fl-timely-key", "plain": "fl-plain-key"}
ADMIN_KEY = "fl-admin-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("deadlines") / "tenants.toml"
    targets = {"timely": {"ttft_target_ms": 800, "itl_target_ms": 40}}
    path.write_text(tenants_toml(KEYS, admin_key=ADMIN_KEY, settings=targets))
    started = ServerThread(instant_context(tenants_file=str(path))).start()
    yield started
    started.stop()


def chat(server: ServerThread, tenant: str, **extra: Any) -> httpx.Response:
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {KEYS[tenant]}"})


def submitted(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[tuple[EngineRequest, float]]:
    """The engine requests the server submits from now on, each with the time it was submitted."""
    seen: list[tuple[EngineRequest, float]] = []
    engine = server.context.engine
    real = engine.submit

    def recording(request: EngineRequest) -> Any:
        seen.append((request, time.monotonic()))
        return real(request)

    monkeypatch.setattr(engine, "submit", recording)
    return seen


@pytest.mark.parametrize(("tenant", "extra", "due_in_s"), [
    ("plain", {"metadata": {"ttft_deadline_ms": "250"}}, 0.25),
    ("timely", {}, 0.8),  # the tenant's target
    ("timely", {"metadata": {"ttft_deadline_ms": "100"}}, 0.1),  # the request's own goes first
    ("plain", {}, None),
    ("timely", {"service_tier": "flex"}, None),  # a target is for interactive work
])
def test_the_deadline_reaches_the_engine_request(server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                                                 tenant: str, extra: dict[str, Any], due_in_s: float | None) -> None:
    seen = submitted(server, monkeypatch)
    assert chat(server, tenant, **extra).status_code == 200
    request, at = seen[0]
    if due_in_s is None:
        assert request.ttft_deadline is None
    else:
        assert request.ttft_deadline is not None
        assert at - 1.0 <= request.ttft_deadline - due_in_s <= at


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "99999999"])
def test_a_malformed_deadline_is_a_400(server: ServerThread, value: str) -> None:
    response = chat(server, "plain", metadata={"ttft_deadline_ms": value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "ttft_deadline_ms" in error["message"] and error["type"] == "invalid_request_error"


def test_met_and_missed_deadlines_are_counted_per_tenant(server: ServerThread) -> None:
    assert chat(server, "plain", metadata={"ttft_deadline_ms": "0.001"}).status_code == 200  # due at once: missed
    assert chat(server, "timely").status_code == 200  # 800 ms on an instant executor: met
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30,
                        headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    counted = {line.split("{")[1].split("}")[0].split(",", 1)[1] for line in metrics.splitlines()
               if line.startswith("fairlane:ttft_deadlines_total{")}
    assert {'outcome="missed",tenant="plain"', 'outcome="met",tenant="timely"'} <= counted


def test_a_tenants_itl_target_reaches_its_interactive_requests(server: ServerThread,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen = submitted(server, monkeypatch)
    for tenant, extra in (("timely", {}), ("timely", {"service_tier": "flex"}), ("plain", {})):
        assert chat(server, tenant, **extra).status_code == 200
    assert [request.itl_target_s for request, _ in seen] == [0.04, None, None]
