"""A tenant's 429s past its free rate are answered after a pause, its own only: a client looping on a limit
sends a few requests a second instead of hundreds, on a real server."""

from __future__ import annotations

import asyncio
import time

import httpx

from app.plumbing.rejection_pacing import RejectionPacing
from tests.app.conftest import stepped_server
from tests.app.test_responses_background_stream import client_of, reattach, running_streamed_response
from tests.factories import wait_until


def test_refusals_past_the_free_rate_are_paused_each_tenant_apart() -> None:
    clock = [0.0]
    pacing = RejectionPacing(free_per_s=3, pause_s=1.5, max_paused=2, clock=lambda: clock[0])
    assert [pacing.pause_for("alice") for _ in range(4)] == [0.0, 0.0, 0.0, 1.5]
    assert pacing.pause_for("bob") == 0.0  # bob's rate is his own
    clock[0] = 1.0  # a second refills the bucket
    assert [pacing.pause_for("alice") for _ in range(4)] == [0.0, 0.0, 0.0, 1.5]


async def test_a_tenant_holds_at_most_max_paused_refusals_the_rest_answered_at_once() -> None:
    """A client that sends without waiting must not hold the server's sockets in paused answers."""
    pacing = RejectionPacing(free_per_s=1, pause_s=30, max_paused=2)
    pacing.pause_for("alice")  # its free refusal
    paused = [asyncio.create_task(pacing.pace("alice")) for _ in range(2)]
    await wait_until(lambda: pacing.paused["alice"] == 2)
    assert pacing.pause_for("alice") == 0.0  # past max_paused: at once
    for task in paused:
        task.cancel()
    await asyncio.gather(*paused, return_exceptions=True)
    assert pacing.paused == {}  # cancelled pauses give their places back


def test_a_client_looping_on_a_429_is_paced_by_the_server() -> None:
    pause_s = 2.0
    server, executor = stepped_server(tenant_max_reattached_streams=1, tenant_refusals_per_s=2.0,
                                      refusal_pause_s=pause_s)
    try:
        with client_of(server) as client:
            response_id = running_streamed_response(client, server, executor)
            with reattach(client, response_id) as following:
                next(iter(following))  # holds the tenant's one slot: every other re-attachment is a 429
                took = []
                for _ in range(3):
                    started = time.monotonic()
                    response = httpx.get(f"{server.base_url}/v1/responses/{response_id}?stream=true", timeout=30)
                    took.append(time.monotonic() - started)
                    assert response.status_code == 429
                    assert response.json()["error"]["type"] == "rate_limit_error"
            assert max(took[:2]) < pause_s  # the free ones at once
            assert took[2] >= pause_s  # then paused
    finally:
        executor.open()
        server.stop()
