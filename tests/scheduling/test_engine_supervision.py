"""A supervised engine: a failure of the loop fails every request loudly, an observer's bug stays
its own, a stalled engine says so, the queue is shared by tenant weight, and batch-class work is
refused before interactive work as it fills."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from benchmarks.fake_executors import FakeExecutor
from contract.plan import StepPlan, StepResult
from scheduling.engine import Engine, EngineOverloaded, EngineStopped, TenantOverShare
from scheduling.request import PriorityClass, Request, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry
from tests.factories import collect, make_fake_engine, make_geometry, make_request, running, wait_until


def break_after(engine: Engine, method: str, num_calls: int) -> None:
    """Make the scheduler's `method` raise from its (num_calls + 1)-th call on."""
    original = getattr(engine.scheduler, method)
    calls = [0]

    def failing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > num_calls:
            raise RuntimeError(f"injected {method} failure")
        return original(*args)

    setattr(engine.scheduler, method, failing)


@pytest.mark.parametrize("method", ["schedule", "update", "add_request"])
async def test_a_failure_outside_the_executor_fails_every_request_loudly(method: str) -> None:
    engine = make_fake_engine()
    failures: list[str] = []
    engine.on_failure.append(failures.append)
    break_after(engine, method, 2)
    async with running(engine):
        streams = [engine.submit(make_request(8, 50)) for _ in range(3)]
        results = [await collect(stream, timeout=10) for stream in streams]
        await wait_until(lambda: engine.failure is not None, what="the engine to fail")

    assert all(events[-1].finish_reason == "error" for events in results)
    assert all(f"injected {method} failure" in (events[-1].error or "") for events in results)
    assert failures == [engine.failure] and f"injected {method} failure" in failures[0]
    health = engine.health()
    assert not health.is_healthy and health.reason is not None and "injected" in health.reason
    with pytest.raises(EngineStopped, match="failed"):
        engine.submit(make_request(4, 4))


class RaisingObserver:
    def __init__(self) -> None:
        self.num_calls = 0

    def on_tokens(self, request: Request, event: TokenEvent, now: float) -> None:
        self.num_calls += 1
        raise ValueError("observer bug")

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None:
        raise ValueError("observer bug")


async def test_an_observer_that_raises_harms_nobody() -> None:
    engine = make_fake_engine()
    observer = RaisingObserver()
    engine.observers.append(observer)
    async with running(engine):
        events = await collect(engine.submit(make_request(8, 6)))

    assert events[-1].finish_reason == "length" and observer.num_calls >= 6
    assert engine.failure is None and engine.health().is_healthy


class BlockingExecutor(FakeExecutor):
    """Holds every step until released."""

    def __init__(self) -> None:
        super().__init__(make_geometry())
        self.release = threading.Event()

    def execute(self, plan: StepPlan) -> StepResult:
        self.release.wait(timeout=30)
        return super().execute(plan)


async def test_a_stalled_engine_is_unhealthy_until_it_moves_again() -> None:
    executor = BlockingExecutor()
    engine = make_fake_engine(executor=executor)
    engine.stall_after_s = 0.05
    async with running(engine):
        stream = engine.submit(make_request(8, 3))
        await wait_until(lambda: not engine.health().is_healthy, what="the stall to be seen")
        reason = engine.health().reason
        executor.release.set()
        await collect(stream)

    assert reason is not None and "has not finished a step" in reason
    assert engine.health().is_healthy  # nothing in flight: an idle engine is not stalled


def weighted_engine(max_queued_requests: int, batch_queue_fraction: float = 0.75) -> Engine:
    tenants = TenantRegistry([Tenant(TenantId("big"), 3.0), Tenant(TenantId("small"), 1.0)], requires_auth=False)
    executor = FakeExecutor(make_geometry())
    return Engine(Scheduler(SchedulerConfig(), executor.geometry, tenants), executor,
                  max_queued_requests=max_queued_requests, batch_queue_fraction=batch_queue_fraction)


def submit_many(engine: Engine, count: int, tenant_id: str, priority: PriorityClass) -> None:
    for _ in range(count):
        engine.submit(make_request(4, 4, tenant_id=tenant_id, priority=priority))


def test_a_flood_fills_the_queue_but_another_tenant_still_gets_in() -> None:
    engine = weighted_engine(max_queued_requests=8)
    for _ in range(8):  # the queue has room: "big" borrows the idle tenant's share
        engine.submit(make_request(4, 4, tenant_id="big"))
    with pytest.raises(EngineOverloaded) as alone:  # full, and nobody else waits: the server is full
        engine.submit(make_request(4, 4, tenant_id="big"))
    admitted = [engine.submit(make_request(4, 4, tenant_id="small")) for _ in range(2)]  # its share is 8 * 1/4

    assert not isinstance(alone.value, TenantOverShare)
    assert len(admitted) == 2 and engine.num_unfinished == 10
    for tenant in ("small", "big"):
        with pytest.raises(TenantOverShare):
            engine.submit(make_request(4, 4, tenant_id=tenant))


def test_weights_set_the_shares() -> None:
    engine = weighted_engine(max_queued_requests=8)
    for _ in range(8):
        engine.submit(make_request(4, 4, tenant_id="small"))
    # Full, and "small" holds everything: "big" (weight 3 of 4) may hold up to 6 before it is over.
    for _ in range(6):
        engine.submit(make_request(4, 4, tenant_id="big"))
    with pytest.raises(TenantOverShare):
        engine.submit(make_request(4, 4, tenant_id="big"))
    assert engine.queue_share("big") == 6.0 and engine.queue_share("small") == 2.0


def test_batch_is_refused_past_its_fraction_while_interactive_still_gets_in() -> None:
    engine = weighted_engine(max_queued_requests=8, batch_queue_fraction=0.5)
    submit_many(engine, 4, "big", PriorityClass.BATCH)  # batch may fill 8 x 0.5 = 4 places
    with pytest.raises(EngineOverloaded) as batch_refused:  # alone in the queue: the server is full for batch
        engine.submit(make_request(4, 4, tenant_id="big", priority=PriorityClass.BATCH))
    submit_many(engine, 4, "big", PriorityClass.INTERACTIVE)  # interactive has the rest of the queue
    with pytest.raises(EngineOverloaded):
        engine.submit(make_request(4, 4, tenant_id="big", priority=PriorityClass.INTERACTIVE))

    assert not isinstance(batch_refused.value, TenantOverShare)
    assert "batch-class requests may fill 4" in str(batch_refused.value)
    assert engine.num_unfinished == 8


def test_interactive_requests_count_against_the_batch_limit() -> None:
    engine = weighted_engine(max_queued_requests=8, batch_queue_fraction=0.5)
    submit_many(engine, 4, "big", PriorityClass.INTERACTIVE)
    with pytest.raises(EngineOverloaded):
        engine.submit(make_request(4, 4, tenant_id="big", priority=PriorityClass.BATCH))
    engine.submit(make_request(4, 4, tenant_id="big", priority=PriorityClass.INTERACTIVE))
    assert engine.num_unfinished == 5


def test_past_the_batch_limit_weighted_shares_of_it_still_hold() -> None:
    engine = weighted_engine(max_queued_requests=8, batch_queue_fraction=0.5)
    submit_many(engine, 4, "big", PriorityClass.INTERACTIVE)
    # The batch limit (4) is reached. "small" (weight 1 of 4) is under its share of it, 4 x 1/4 = 1:
    # one batch request gets in, the next is over its share; "big" already holds more than its 3.
    engine.submit(make_request(4, 4, tenant_id="small", priority=PriorityClass.BATCH))
    for tenant in ("small", "big"):
        with pytest.raises(TenantOverShare):
            engine.submit(make_request(4, 4, tenant_id=tenant, priority=PriorityClass.BATCH))
    submit_many(engine, 3, "big", PriorityClass.INTERACTIVE)  # interactive still has room up to 8

    assert engine.queue_share("small", PriorityClass.BATCH) == 1.0
    assert engine.queue_share("big", PriorityClass.BATCH) == 3.0
    assert engine.num_unfinished == 8


@pytest.mark.parametrize(("max_queued", "fraction", "batch_limit"),
                         [(1024, 0.75, 768), (10, 0.75, 8), (1, 0.75, 1), (1, 0.01, 1), (8, 1.0, 8)])
def test_the_batch_limit_rounds_up_to_at_least_one_place(max_queued: int, fraction: float, batch_limit: int) -> None:
    engine = weighted_engine(max_queued_requests=max_queued, batch_queue_fraction=fraction)
    assert engine.queue_limit(PriorityClass.BATCH) == batch_limit
    assert engine.queue_limit(PriorityClass.INTERACTIVE) == max_queued


async def test_service_folded_in_reaches_the_counters_through_the_engines_task() -> None:
    """Another replica's service is a command: the caller never touches the scheduler, and the idle
    engine's task applies it and publishes it in the snapshot."""
    engine = make_fake_engine()
    async with running(engine):
        engine.fold_service({"batch": {"alice": 6.0}})
        await wait_until(lambda: engine.snapshot.vtc["batch"].get("alice") == 6.0, what="the folded service")

    assert engine.scheduler.vtc[PriorityClass.BATCH].get("alice") == 6.0
    assert engine.scheduler.vtc[PriorityClass.INTERACTIVE].get("alice") == 0.0
