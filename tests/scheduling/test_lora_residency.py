"""LoRA slot residency in the scheduler (torch-free): a request whose adapter has no slot waits while others
run, the least recently used unpinned slot is reused, a slot of a running request never is, and preempted
requests take a slot again when they resume."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.fake_executors import FakeExecutor
from contract.plan import BASE_MODEL_SLOT, LoraRef, StepPlan
from scheduling.lora_residency import LoraResidency
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import AdmissionError, Scheduler, SchedulerConfig
from tests.factories import (
    assert_kv_all_free,
    collect,
    make_fake_engine,
    make_request,
    make_scheduler,
    run_step,
    run_to_completion,
    running,
    tokens_of,
)

A, B, C = (LoraRef(name, f"/adapters/{name}", 1) for name in ("a", "b", "c"))


def lora_scheduler(max_loras: int = 2, **config: object) -> tuple[Scheduler, FakeExecutor]:
    scheduler = make_scheduler(SchedulerConfig(max_loras=max_loras, **config))  # type: ignore[arg-type]
    return scheduler, FakeExecutor(scheduler.geometry)


def on(adapter: LoraRef | None, max_tokens: int = 4, **kwargs: object) -> Request:
    request = make_request(8, max_tokens, **kwargs)  # type: ignore[arg-type]
    request.adapter = adapter
    return request


def slots_of(plan: StepPlan) -> dict[str, int]:
    return {seq.request_id: seq.lora_slot for seq in plan.sequences}


def test_residency_reuses_the_least_recently_used_unpinned_slot() -> None:
    residency = LoraResidency(2)
    first, second = residency.acquire(A), residency.acquire(B)
    assert first is not None and second is not None and first.needs_load and second.needs_load
    assert residency.acquire(C) is None  # both pinned: nothing changes
    assert residency.resident() == [A, B]
    residency.release(second.slot)
    residency.release(first.slot)  # A is now the most recently used
    third = residency.acquire(C)
    assert third is not None and third.slot == second.slot and third.needs_load
    again = residency.acquire(A)
    assert again is not None and again.slot == first.slot and not again.needs_load  # still resident
    assert residency.slot_of(B) is None


def test_a_slot_in_use_is_never_evicted() -> None:
    residency = LoraResidency(1)
    grant = residency.acquire(A)
    assert grant is not None
    assert not residency.can_acquire(B) and residency.acquire(B) is None
    assert residency.can_acquire(A) and residency.can_acquire(None)
    shared = residency.acquire(A)  # a second request of the same adapter shares the slot
    assert shared is not None and shared.slot == grant.slot and not shared.needs_load
    residency.release(grant.slot)
    assert residency.acquire(B) is None  # the second request still pins it
    residency.release(grant.slot)
    taken = residency.acquire(B)
    assert taken is not None and taken.needs_load
    residency.release(taken.slot)
    with pytest.raises(AssertionError, match="released more often"):
        residency.release(taken.slot)


def test_residency_says_which_slots_are_pinned_and_keeps_slots_unpinned_when_asked() -> None:
    residency = LoraResidency(2)
    grant = residency.acquire(A)
    assert grant is not None
    assert residency.is_pinned(A) and not residency.is_pinned(B) and residency.num_unpinned == 1
    assert residency.pinned_slots() == {grant.slot: 1}
    assert residency.can_acquire(A, keep_unpinned=1)  # sharing its pinned slot takes no unpinned one
    assert residency.can_acquire(B) and not residency.can_acquire(B, keep_unpinned=1)
    residency.release(grant.slot)
    assert not residency.is_pinned(A) and residency.pinned_slots() == {} and residency.num_unpinned == 2
    assert residency.can_acquire(A, keep_unpinned=1) and not residency.can_acquire(A, keep_unpinned=2)


def test_the_plan_loads_each_adapter_once_and_gives_every_sequence_its_slot() -> None:
    scheduler, executor = lora_scheduler(max_loras=2)
    requests = [on(A), on(B), on(None), on(A)]
    for request in requests:
        scheduler.add_request(request)
    plan, _ = run_step(scheduler, executor)
    assert sorted(ref.name for _, ref in plan.lora_loads) == ["a", "b"]
    slot_of = {ref: slot for slot, ref in plan.lora_loads}
    assert slots_of(plan) == {requests[0].request_id: slot_of[A], requests[1].request_id: slot_of[B],
                              requests[2].request_id: BASE_MODEL_SLOT, requests[3].request_id: slot_of[A]}
    later, _ = run_step(scheduler, executor)
    assert later.lora_loads == [] and slots_of(later) == slots_of(plan)  # resident: no load again


def test_a_request_waits_for_a_slot_while_others_run() -> None:
    scheduler, executor = lora_scheduler(max_loras=1)
    first, blocked, base = on(A, max_tokens=6, tenant_id="t1"), on(B, tenant_id="t2"), on(None, tenant_id="t3")
    for request in (first, blocked, base):
        scheduler.add_request(request)
    plan, _ = run_step(scheduler, executor)
    assert set(slots_of(plan)) == {first.request_id, base.request_id}  # the base request is not held back
    assert blocked.status is RequestStatus.WAITING
    while first.status is RequestStatus.RUNNING:
        plan, _ = run_step(scheduler, executor)
        assert blocked.request_id not in slots_of(plan)  # A's slot is pinned until its request ends
    plan, _ = run_step(scheduler, executor)
    assert plan.lora_loads == [(0, B)] and slots_of(plan)[blocked.request_id] == 0
    run_to_completion(scheduler, executor)
    assert scheduler.lora.num_pins(0) == 0


@pytest.mark.parametrize("max_num_seqs", [3, 64])
def test_more_adapters_than_slots_all_finish_each_on_its_own_slot(max_num_seqs: int) -> None:
    scheduler, executor = lora_scheduler(max_loras=2, max_num_seqs=max_num_seqs)
    adapters = [LoraRef(f"x{i}", f"/adapters/x{i}", 1) for i in range(5)]
    made = [on(adapters[i % 5], max_tokens=1 + i % 3, tenant_id=f"t{i % 4}") for i in range(12)]
    requests: dict[str, Request] = {r.request_id: r for r in made}
    for request in requests.values():
        scheduler.add_request(request)
    num_loads = 0
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        loaded_slots = [slot for slot, _ in plan.lora_loads]
        assert len(set(loaded_slots)) == len(loaded_slots)  # one load per slot per step
        num_loads += len(loaded_slots)
        resident = scheduler.lora.resident()  # what the slots hold once the plan's loads are made
        for seq in plan.sequences:  # so a load never overwrote the adapter of a sequence the step runs
            assert resident[seq.lora_slot] == requests[seq.request_id].adapter
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests.values())
    assert num_loads >= 5 and scheduler.lora.num_pins(0) == scheduler.lora.num_pins(1) == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_request_takes_its_adapter_slot_again(mode: str) -> None:
    scheduler = make_scheduler(SchedulerConfig(max_loras=1, max_num_seqs=1, preemption_mode=mode),
                               num_device_blocks=64, num_cpu_blocks=64)
    executor = FakeExecutor(scheduler.geometry)
    batch = on(A, max_tokens=8, priority=PriorityClass.BATCH, tenant_id="b")
    scheduler.add_request(batch)
    run_step(scheduler, executor)
    interactive = on(B, max_tokens=2, tenant_id="i")  # max_num_seqs=1: the batch request gives way
    scheduler.add_request(interactive)
    plan, _ = run_step(scheduler, executor)
    assert batch.status is not RequestStatus.RUNNING and batch.lora_slot == BASE_MODEL_SLOT
    assert slots_of(plan) == {interactive.request_id: 0} and plan.lora_loads == [(0, B)]
    events = run_to_completion(scheduler, executor)
    assert events[batch.request_id][-1].finish_reason == "length" and batch.num_output_tokens == 8
    assert scheduler.lora.resident() == [A] and scheduler.lora.num_pins(0) == 0


def test_an_adapter_request_needs_an_engine_with_slots() -> None:
    scheduler = make_scheduler()
    with pytest.raises(AdmissionError, match="without LoRA slots"):
        scheduler.add_request(on(A))


async def test_the_engine_runs_adapter_requests_and_refuses_them_without_slots() -> None:
    without = make_fake_engine()
    with pytest.raises(AdmissionError, match="without LoRA slots"):
        without.submit(on(A))  # at the door: the engine's loop never sees it
    engine = make_fake_engine(config=SchedulerConfig(max_loras=1))
    async with running(engine):
        requests = [on(A, max_tokens=5), on(B, max_tokens=3), on(None, max_tokens=4), on(A, max_tokens=2)]
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
    for request, events in zip(requests, results, strict=True):
        assert len(tokens_of(events)) == request.max_tokens and events[-1].finish_reason == "length"
    assert_kv_all_free(engine)
    assert engine.scheduler.lora.num_pins(0) == 0
