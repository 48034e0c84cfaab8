"""Each tenant's file transfers paced to its byte rate: a second's worth at once, then the rate, its own
bucket per tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from app.plumbing.byte_rate import ByteRate


def test_a_tenant_gets_a_seconds_worth_at_once_then_the_rate() -> None:
    now = [0.0]
    rate = ByteRate(bytes_per_s=1000, clock=lambda: now[0])
    assert rate.delay_for("alice", 600) == 0.0
    assert rate.delay_for("alice", 400) == 0.0  # the bucket is a second deep
    assert rate.delay_for("alice", 500) == 0.5  # past it, the wait its bytes cost
    assert rate.delay_for("bob", 1000) == 0.0  # bob's bucket is his own
    now[0] = 2.0  # refilled, never past a second's worth
    assert rate.delay_for("alice", 1000) == 0.0
    assert rate.delay_for("alice", 100) == 0.1


async def test_shaped_chunks_take_as_long_as_their_bytes_cost() -> None:
    rate = ByteRate(bytes_per_s=64 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"x" * 32 * 1024

    loop = asyncio.get_running_loop()
    started = loop.time()
    received = [chunk async for chunk in rate.shaped("alice", chunks())]
    assert b"".join(received) == b"x" * 128 * 1024
    assert loop.time() - started >= 0.95  # 64 KiB at once, then 64 KiB at 64 KiB/s
