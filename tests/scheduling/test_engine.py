"""The engine loop: streams, aborts at every stage, and that no KV block outlives its request.

The lifecycle tests run twice: over the FakeExecutor and over the real runner on builtin:tiny.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import pytest

from benchmarks.fake_executors import FailingExecutor
from scheduling.engine import Engine, EngineOverloaded, EngineStopped
from scheduling.request import Request, RequestStatus, TokenEvent
from scheduling.scheduler import AdmissionError, SchedulerConfig
from tests.factories import (
    assert_kv_all_free,
    collect,
    make_engine,
    make_fake_engine,
    make_geometry,
    make_request,
    plans_of,
    running,
    tokens_of,
    wait_until,
)


class EngineBuilder(Protocol):
    def __call__(self, *, num_blocks: int = ..., block_size: int = ...,
                 config: SchedulerConfig | None = ...) -> Engine: ...


@pytest.fixture(params=["fake", "tiny"])
def build_engine(request: pytest.FixtureRequest) -> EngineBuilder:
    if request.param == "fake":
        return make_fake_engine
    loaded = request.getfixturevalue("tiny_model")

    def build(*, num_blocks: int = 256, block_size: int = 4, config: SchedulerConfig | None = None) -> Engine:
        return make_engine(loaded, num_blocks=num_blocks, block_size=block_size, config=config)

    return build


async def finish_and_check(engine: Engine) -> None:
    assert await engine.wait_idle(timeout=20), f"{engine.num_unfinished} requests still in flight"
    await wait_until(lambda: not engine.scheduler.has_work(), what="the scheduler to drain")
    assert_kv_all_free(engine)


async def test_every_block_is_free_after_all_finish(build_engine: EngineBuilder) -> None:
    engine = build_engine(num_blocks=64, config=SchedulerConfig(max_num_batched_tokens=32))
    requests = [make_request(length, max_tokens) for length, max_tokens in ((1, 5), (7, 9), (33, 3), (60, 12))]
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
        await finish_and_check(engine)
    for request, events in zip(requests, results, strict=True):
        assert len(tokens_of(events)) == request.max_tokens
        assert events[-1].finish_reason == "length"
    assert engine.stats()["requests_finished"] == len(requests)


async def test_abort_before_the_engine_sees_it(build_engine: EngineBuilder) -> None:
    engine = build_engine()
    async with running(engine):
        request = make_request(12, max_tokens=8)
        stream = engine.submit(request)
        stream.close()
        assert [event async for event in stream] == []  # a closed stream yields nothing more
        await finish_and_check(engine)
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert all(not plan.sequences for plan in plans_of(engine))  # the model never ran it
        assert engine.stats()["requests_aborted"] == 1


async def test_abort_while_waiting_for_a_slot(build_engine: EngineBuilder) -> None:
    engine = build_engine(config=SchedulerConfig(max_num_seqs=1))
    async with running(engine):
        ahead = make_request(8, max_tokens=500)
        ahead_stream = engine.submit(ahead)
        await wait_until(lambda: ahead.num_output_tokens > 0, interval=0, what="the first request to decode")
        queued = make_request(8, max_tokens=8)
        queued_stream = engine.submit(queued)
        await wait_until(lambda: queued.request_id in engine.scheduler.requests, interval=0,
                         what="the second request to be queued")
        assert queued.status is RequestStatus.WAITING and ahead.status is RequestStatus.RUNNING
        queued_stream.close()
        await wait_until(lambda: engine.stats()["requests_aborted"] == 1, what="the abort")
        assert queued.num_computed_tokens == 0 and engine.scheduler.blocks.block_table(queued.request_id) == ()
        ahead_stream.close()
        await finish_and_check(engine)
    assert engine.stats()["requests_aborted"] == 2


async def test_abort_mid_prefill(build_engine: EngineBuilder) -> None:
    engine = build_engine(config=SchedulerConfig(max_num_batched_tokens=8))
    async with running(engine):
        request = make_request(160, max_tokens=8)  # twenty steps of prefill
        stream = engine.submit(request)
        await wait_until(lambda: request.num_computed_tokens > 0, interval=0, what="the first prefill chunk")
        assert request.num_computed_tokens < request.num_prompt_tokens
        stream.close()
        await finish_and_check(engine)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert request.num_output_tokens == 0
    assert request.num_computed_tokens < request.num_prompt_tokens
    assert engine.stats()["requests_aborted"] == 1


async def test_abort_while_decoding_leaves_neighbours_alone(build_engine: EngineBuilder) -> None:
    engine = build_engine()
    async with running(engine):
        request, neighbour = make_request(10, max_tokens=100), make_request(6, max_tokens=30)
        stream, neighbour_task = engine.submit(request), asyncio.create_task(collect(engine.submit(neighbour)))
        received: list[TokenEvent] = []
        async with asyncio.timeout(20):
            async for event in stream:
                received.append(event)
                if len(received) == 3:
                    stream.close()
        neighbour_events = await neighbour_task
        await finish_and_check(engine)
    assert len(received) == 3
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert 3 <= request.num_output_tokens < request.max_tokens
    assert len(tokens_of(neighbour_events)) == 30 and neighbour_events[-1].finish_reason == "length"
    assert engine.stats()["requests_aborted"] == 1


async def test_abort_of_a_finished_request_changes_nothing(build_engine: EngineBuilder) -> None:
    engine = build_engine()
    async with running(engine):
        request = make_request(5, max_tokens=3)
        stream = engine.submit(request)
        events = await collect(stream)
        stream.close()
        engine.finish(request.request_id)
        await finish_and_check(engine)
    assert events[-1].finish_reason == "length"
    assert engine.stats()["requests_aborted"] == 0
    assert engine.stats()["requests_finished"] == 1


# ---- the engine's own refusals and failures (fake executor only) ---------------------------


async def test_full_engine_refuses_with_overloaded() -> None:
    engine = make_fake_engine(max_queued_requests=2)
    engine.submit(make_request(4, 4))
    engine.submit(make_request(4, 4))
    with pytest.raises(EngineOverloaded):
        engine.submit(make_request(4, 4))
    async with running(engine):
        await finish_and_check(engine)


async def test_stopping_engine_refuses_new_requests() -> None:
    engine = make_fake_engine()
    engine.stop_accepting()
    with pytest.raises(EngineStopped):
        engine.submit(make_request(4, 4))


async def test_inadmissible_request_is_refused_at_submit() -> None:
    engine = make_fake_engine(num_blocks=4, block_size=4)
    with pytest.raises(AdmissionError):
        engine.submit(make_request(10, max_tokens=10))
    assert engine.num_unfinished == 0


async def test_executor_failure_ends_every_request_with_an_error() -> None:
    engine = make_fake_engine(executor=FailingExecutor(make_geometry(num_device_blocks=64), fail_at=3))
    requests: list[Request] = [make_request(6, max_tokens=20) for _ in range(3)]
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
        await finish_and_check(engine)
    for events in results:
        assert events[-1].finish_reason == "error"
        assert events[-1].error is not None and "RuntimeError" in events[-1].error


async def test_shutdown_ends_requests_in_flight_with_an_error() -> None:
    engine = make_fake_engine()
    request = make_request(6, max_tokens=1000)
    stream = engine.submit(request)
    async with running(engine):
        await wait_until(lambda: request.num_output_tokens > 0, interval=0, what="decoding")
    events = await collect(stream)
    assert events[-1].finish_reason == "error"
    assert_kv_all_free(engine)
