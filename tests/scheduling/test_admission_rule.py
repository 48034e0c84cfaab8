"""The one admission rule (scheduling/admission.py): what it holds back, and how, for a waiting request and
a swapped one; and the counting pass and the starting pass agree, since both ask it."""

from __future__ import annotations

from benchmarks.fake_executors import FakeExecutor
from contract.plan import StepPlan
from scheduling.admission import Hold, RoomNow
from scheduling.interactive_room import RoomCount
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantLimits, TenantRegistry
from tests.factories import make_request, make_scheduler

BATCH, INTERACTIVE = PriorityClass.BATCH, PriorityClass.INTERACTIVE


def limited(**max_concurrent: int) -> TenantRegistry:
    return TenantRegistry([Tenant(TenantId(name), limits=TenantLimits(max_concurrent=limit))
                           for name, limit in max_concurrent.items()], requires_auth=False)


def step(scheduler: Scheduler, executor: FakeExecutor) -> None:
    plan = scheduler.schedule()
    scheduler.update(plan, executor.execute(plan))


def submit(scheduler: Scheduler, tenant: str, priority: PriorityClass = INTERACTIVE, prompt: int = 8,
           max_tokens: int = 20) -> Request:
    request = make_request(prompt, max_tokens, tenant_id=tenant, priority=priority)
    scheduler.add_request(request)
    return request


def test_a_waiting_request_held_back_passes_its_tenant_over_and_a_swapped_one_waits_alone() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=64), num_cpu_blocks=64,
                               tenants=limited(a=1))
    executor = FakeExecutor(scheduler.geometry)
    running = submit(scheduler, "a")
    step(scheduler, executor)
    waiting = submit(scheduler, "a")
    room = RoomNow(scheduler.lora, scheduler.load)

    assert scheduler.admission.verdict(waiting, 64, room, set()).hold is Hold.TENANT  # a's max_concurrent
    scheduler._preempt(running, StepPlan(), INTERACTIVE)  # swapped out by hand
    assert running.status is RequestStatus.SWAPPED
    room = RoomNow(scheduler.lora, scheduler.load)
    assert scheduler.admission.verdict(waiting, 64, room, {"a"}).hold is Hold.TENANT  # passed over
    verdict = scheduler.admission.verdict(running, 64, room, set())
    assert verdict.hold is None
    assert verdict.num_new == 1  # its next token
    # its own blocks come back, and one more only if that token starts a block
    assert verdict.num_blocks == -(-(running.num_computed_tokens + 1) // scheduler.geometry.block_size)
    assert verdict.num_blocks >= scheduler.blocks.num_cpu_blocks(running.request_id)
    scheduler.load.started_running(waiting)  # now a's one place is taken: the swapped request waits, alone
    assert scheduler.admission.verdict(running, 64, RoomNow(scheduler.lora, scheduler.load), set()).hold \
        is Hold.REQUEST


def test_a_request_counted_for_room_is_one_the_starting_pass_starts() -> None:
    """Tenant a's max_concurrent is taken by its own batch work and tenant b is over its KV share: the
    interactive request of a is counted (its batch request gives way) and started in that very step; b's is
    counted by neither pass."""
    tenants = limited(a=1, b=8)
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=64), num_device_blocks=64,
                               num_cpu_blocks=64, tenants=tenants)
    executor = FakeExecutor(scheduler.geometry)
    batch_of_a = submit(scheduler, "a", BATCH, max_tokens=100)
    hog = [submit(scheduler, "b", prompt=40, max_tokens=100) for _ in range(2)]
    step(scheduler, executor)
    step(scheduler, executor)
    chat_of_a = submit(scheduler, "a", max_tokens=4)
    chat_of_b = submit(scheduler, "b", prompt=40, max_tokens=4)
    submit(scheduler, "c", prompt=40, max_tokens=4)  # another tenant waiting: b's share counts

    demand, _ = scheduler._count_interactive_demand(64, RoomCount(scheduler.lora, scheduler.load,
                                                                  scheduler.running))
    assert chat_of_a in demand.requests and chat_of_b not in demand.requests
    step(scheduler, executor)
    assert chat_of_a.status is RequestStatus.RUNNING and batch_of_a.status is not RequestStatus.RUNNING
    assert chat_of_b.status is RequestStatus.WAITING
    assert all(r.status is RequestStatus.RUNNING for r in hog)
