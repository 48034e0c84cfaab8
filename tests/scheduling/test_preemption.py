"""Interactive requests preempt batch ones by swapping their KV to the CPU pool (recompute when the
pool is full or swap is off); preempted requests resume exactly where they stopped.

The scheduler-level tests drive `schedule()` / `update()` with a fake executor whose tokens are a
pure function of request and position; the engine-level ones run builtin:tiny with a KV budget
small enough that preemption must happen, and compare tokens with runs that never preempt.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.fake_executors import FakeExecutor
from contract.plan import StepPlan
from gpu.models import LoadedModel
from scheduling.preemption import PreemptionMode, choose_victim, victims_in_order
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import make_geometry, make_request, run_step, running, tokens_of, wait_until
from tests.scheduling.preemption_helpers import (
    RequestSpec,
    assert_all_blocks_free,
    build_engine,
    reference_outputs,
    specs,
    submit,
)

BATCH = PriorityClass.BATCH
INTERACTIVE = PriorityClass.INTERACTIVE


# ---- the scheduler's phases, with a fake executor ------------------------------------------------


def fake_scheduler(*, num_device_blocks: int = 12, num_cpu_blocks: int = 32, max_num_batched_tokens: int = 64,
                   batch_min_share: float = 0.0) -> tuple[Scheduler, FakeExecutor]:
    geometry = make_geometry(num_device_blocks=num_device_blocks, num_cpu_blocks=num_cpu_blocks, block_size=4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                             batch_min_share=batch_min_share)
    return Scheduler(config, geometry), FakeExecutor(geometry)


def ids_in(plan: StepPlan) -> set[str]:
    return {seq.request_id for seq in plan.sequences}


def fill_kv_with_batch(scheduler: Scheduler, executor: FakeExecutor) -> list[Request]:
    """Three batch requests decode until they hold every device block."""
    batch = [make_request(12, 24, priority=BATCH) for _ in range(3)]
    for request in batch:
        scheduler.add_request(request)
    for _ in range(10):
        if scheduler.blocks.device.num_free == 0:
            return batch
        run_step(scheduler, executor)
    raise AssertionError("the batch requests never filled the KV memory")


def test_victims_in_order_is_the_order_of_repeated_choices() -> None:
    """One sort stands for a burst of choose_victim calls, ties included (arrival times repeat here)."""
    candidates = [make_request(4, priority=BATCH, arrival_time=float(i % 3)) for i in range(9)]
    repeated, left = [], list(candidates)
    while (victim := choose_victim(left, BATCH)) is not None:
        repeated.append(victim)
        left.remove(victim)
    assert victims_in_order(candidates) == repeated


def test_interactive_arrival_swaps_out_batch_in_the_very_next_plan() -> None:
    scheduler, executor = fake_scheduler()
    batch = fill_kv_with_batch(scheduler, executor)
    newest = batch[-1]
    blocks_before, computed_before = scheduler.blocks.block_table(newest.request_id), newest.num_computed_tokens
    interactive = make_request(8, 4, priority=INTERACTIVE)
    scheduler.add_request(interactive)

    plan = scheduler.schedule()

    # The newest batch request gives way; its copies are in this plan, which the runner makes
    # before the forward, so its device blocks can be written by the interactive prefill right away.
    assert newest.status is RequestStatus.SWAPPED
    assert plan.swap_out == list(zip(blocks_before, scheduler.blocks.cpu_blocks(newest.request_id), strict=True))
    assert newest.num_computed_tokens == computed_before
    assert newest.request_id not in ids_in(plan)
    assert interactive.request_id in ids_in(plan)
    interactive_seq = next(s for s in plan.sequences if s.request_id == interactive.request_id)
    assert set(interactive_seq.block_table) & set(blocks_before)
    assert [e.victim_id for e in scheduler.preemption_log] == [newest.request_id]
    assert scheduler.preemption_log[0].for_class is INTERACTIVE
    assert scheduler.preemption_log[0].mode is PreemptionMode.SWAP
    scheduler.update(plan, executor.execute(plan))


def test_swapped_request_keeps_its_progress_and_swaps_in_when_room_returns() -> None:
    scheduler, executor = fake_scheduler()
    batch = fill_kv_with_batch(scheduler, executor)
    newest = batch[-1]
    scheduler.add_request(make_request(8, 6, priority=INTERACTIVE))
    num_swap_ins = 0
    for _ in range(200):
        if not scheduler.has_work():
            break
        was_swapped = newest.status is RequestStatus.SWAPPED
        computed, tokens = newest.num_computed_tokens, list(newest.token_ids)
        cpu_blocks = scheduler.blocks.cpu_blocks(newest.request_id)
        plan, _ = run_step(scheduler, executor)
        if not was_swapped:
            continue
        if newest.status is RequestStatus.SWAPPED:  # still out: nothing about it moves
            still = (newest.num_computed_tokens, newest.token_ids, scheduler.blocks.cpu_blocks(newest.request_id))
            assert still == (computed, tokens, cpu_blocks)
            assert not [pair for pair in plan.swap_in if pair[0] in cpu_blocks]
        else:  # back in: its CPU blocks are copied to device blocks in this plan, nothing recomputed
            num_swap_ins += 1
            its_pairs = [pair for pair in plan.swap_in if pair[0] in cpu_blocks]
            device_blocks = scheduler.blocks.block_table(newest.request_id)[:len(cpu_blocks)]
            assert its_pairs == list(zip(cpu_blocks, device_blocks, strict=True))
            resumed = next(s for s in plan.sequences if s.request_id == newest.request_id)
            assert resumed.start_position == computed
    assert num_swap_ins >= 1 and newest.num_preemptions == num_swap_ins
    assert newest.output_token_ids == [executor.token_for(newest.request_id, newest.num_prompt_tokens + k)
                                       for k in range(newest.max_tokens)]
    assert scheduler.blocks.device.num_free == scheduler.blocks.device.num_blocks
    assert scheduler.blocks.cpu.num_free == scheduler.blocks.cpu.num_blocks


def test_full_cpu_pool_falls_back_to_recompute() -> None:
    scheduler, executor = fake_scheduler(num_cpu_blocks=2)
    batch = fill_kv_with_batch(scheduler, executor)
    scheduler.add_request(make_request(8, 4, priority=INTERACTIVE))
    plan, _ = run_step(scheduler, executor)
    newest = batch[-1]
    assert not plan.swap_out
    assert newest.status is RequestStatus.WAITING and newest.num_computed_tokens == 0
    assert scheduler.preemption_log[-1].mode is PreemptionMode.RECOMPUTE


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_batch_min_share_reserves_tokens_while_interactive_prefills(share: float) -> None:
    scheduler, executor = fake_scheduler(num_device_blocks=256, max_num_batched_tokens=32, batch_min_share=share)
    batch = make_request(200, 4, priority=BATCH)
    interactive = make_request(200, 4, priority=INTERACTIVE)
    scheduler.add_request(batch)
    scheduler.add_request(interactive)
    run_step(scheduler, executor)  # the interactive request is admitted first, with the whole budget
    batch_tokens: list[int] = []
    while interactive.num_computed_tokens < interactive.num_prompt_tokens - 32:
        plan, _ = run_step(scheduler, executor)
        batch_tokens.append(sum(len(s.token_ids) for s in plan.sequences if s.request_id == batch.request_id))
        assert plan.num_tokens <= 32
    reserve = int(share * 32)
    assert len(batch_tokens) >= 3
    if reserve:
        assert all(n >= reserve for n in batch_tokens), batch_tokens
    else:
        assert not any(batch_tokens), batch_tokens


# ---- the engine on builtin:tiny ------------------------------------------------------------------

# Batch alone fits (3 x 4 blocks of 16 tokens in 14); the interactive requests need room on top.
BATCH_SPECS = specs("b", BATCH, [(20, 40), (24, 40), (18, 40)])
INTERACTIVE_SPECS = specs("i", INTERACTIVE, [(40, 24), (36, 24)], salt=10)


async def wait_for_decoding(requests: list[Request], num_tokens: int) -> None:
    await wait_until(lambda: all(r.status is RequestStatus.RUNNING and r.num_output_tokens >= num_tokens
                                 for r in requests), interval=0, timeout=60,  # a loaded machine is slow, not wrong
                     what="the batch requests to be decoding")


@pytest.mark.parametrize(("mode", "num_cpu_blocks", "expected"), [
    ("swap", 64, PreemptionMode.SWAP),
    ("swap", 0, PreemptionMode.RECOMPUTE),  # no CPU pool: swap falls back to recompute
    ("recompute", 64, PreemptionMode.RECOMPUTE),
])
async def test_preempted_batch_output_is_token_identical(tiny_model: LoadedModel, mode: str, num_cpu_blocks: int,
                                                         expected: PreemptionMode) -> None:
    reference = await reference_outputs(tiny_model, [*BATCH_SPECS, *INTERACTIVE_SPECS])
    engine, _ = build_engine(tiny_model, num_blocks=14, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode)
    async with running(engine):
        batch = [submit(engine, spec) for spec in BATCH_SPECS]
        # Far enough into decoding that the batch requests hold 12 of the 14 blocks: the interactive
        # arrivals cannot start without taking room from them.
        await wait_for_decoding([request for request, _ in batch], 30)
        interactive = [submit(engine, spec) for spec in INTERACTIVE_SPECS]
        outputs = {request.request_id: tokens_of(await task) for request, task in [*batch, *interactive]}
    log = list(engine.scheduler.preemption_log)
    assert any(e.victim_class is BATCH and e.for_class is INTERACTIVE for e in log), log
    assert {e.mode for e in log} == {expected}
    assert sum(request.num_preemptions for request, _ in batch) >= 1
    assert outputs == reference
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_batch_preempted_several_times_is_token_identical(tiny_model: LoadedModel, mode: str) -> None:
    long_batch = RequestSpec("long", 20, 90, BATCH, salt=3)
    bursts = specs("burst", INTERACTIVE, [(120, 8)] * 3, salt=20)
    reference = await reference_outputs(tiny_model, [long_batch, *bursts])
    engine, _ = build_engine(tiny_model, num_blocks=10, preemption_mode=mode)
    outputs: dict[str, list[int]] = {}
    async with running(engine):
        request, task = submit(engine, long_batch)
        for i, burst in enumerate(bursts):
            # Each burst needs 9 of the 10 blocks, so the batch request gives way every time.
            await wait_for_decoding([request], 10 + 20 * i)
            _, interactive_task = submit(engine, burst)
            outputs[burst.request_id] = tokens_of(await interactive_task)
        outputs[long_batch.request_id] = tokens_of(await task)
    assert request.num_preemptions >= 2
    victims = [e for e in engine.scheduler.preemption_log if e.victim_id == long_batch.request_id]
    assert len(victims) == request.num_preemptions
    assert outputs == reference
    assert_all_blocks_free(engine)


async def first_with_status(requests: list[Request], status: RequestStatus) -> Request:
    await wait_until(lambda: any(r.status is status for r in requests), interval=0, what=f"a request {status.value}")
    return next(r for r in requests if r.status is status)


async def test_aborts_in_every_state_leave_every_block_free(tiny_model: LoadedModel) -> None:
    engine, _ = build_engine(tiny_model, num_blocks=14, max_num_seqs=4)
    batch_specs = specs("b", BATCH, [(20, 40), (24, 40), (18, 40), (30, 30), (16, 30)])
    interactive_specs = specs("i", INTERACTIVE, [(40, 30), (36, 30), (30, 20)], salt=10)
    async with running(engine):
        batch = [spec.build() for spec in batch_specs]
        streams = {request.request_id: engine.submit(request) for request in batch}
        await wait_for_decoding(batch[:3], 2)
        interactive = [spec.build() for spec in interactive_specs]
        streams |= {request.request_id: engine.submit(request) for request in interactive}

        # A swapped batch request, a running interactive one, and a batch one still waiting.
        swapped = await first_with_status(batch, RequestStatus.SWAPPED)
        streams[swapped.request_id].close()
        await wait_until(lambda: interactive[0].num_output_tokens >= 2, interval=0)
        streams[interactive[0].request_id].close()
        waiting = [request for request in batch if request.status is RequestStatus.WAITING]
        assert waiting, "max_num_seqs=4 keeps a batch request waiting"
        streams[waiting[-1].request_id].close()

        await wait_until(lambda: engine.num_unfinished == 0 and not engine.scheduler.has_work(),
                         timeout=30, what="every request to end")
        stats = engine.stats()
        assert stats["requests_aborted"] == 3 and stats["requests_finished"] == len(streams) - 3
        assert stats["preemptions"]["swap"] >= 1
        assert swapped.status is RequestStatus.FINISHED_ABORTED
        assert_all_blocks_free(engine)


async def test_every_batch_request_completes_after_an_interactive_burst(tiny_model: LoadedModel) -> None:
    engine, _ = build_engine(tiny_model, num_blocks=16)
    batch_specs = specs("b", BATCH, [(16 + 3 * i, 30) for i in range(6)])
    burst_specs = specs("i", INTERACTIVE, [(24 + 4 * i, 16) for i in range(6)], salt=40)
    async with running(engine):
        batch = [submit(engine, spec) for spec in batch_specs]
        await wait_until(lambda: sum(r.num_output_tokens > 0 for r, _ in batch) >= 4, interval=0)
        burst = [submit(engine, spec) for spec in burst_specs]
        results = await asyncio.gather(*(task for _, task in [*batch, *burst]))
    assert engine.scheduler.counters.preemptions["swap"] >= 1
    for spec, events in zip([*batch_specs, *burst_specs], results, strict=True):
        assert events[-1].finish_reason == "length", spec
        assert len(tokens_of(events)) == spec.max_tokens, spec
    assert_all_blocks_free(engine)


async def test_interactive_requests_never_give_way_to_batch(tiny_model: LoadedModel) -> None:
    # Three interactive requests of 6 blocks each cannot all fit in 12 blocks: they preempt the
    # batch requests first, then each other.
    engine, watcher = build_engine(tiny_model, num_blocks=12)
    batch_specs = specs("b", BATCH, [(20, 30), (24, 30), (18, 30)])
    interactive_specs = specs("i", INTERACTIVE, [(50, 40), (46, 40), (44, 40)], salt=10)
    async with running(engine):
        batch = [submit(engine, spec) for spec in batch_specs]
        await wait_for_decoding([request for request, _ in batch], 2)
        interactive = [submit(engine, spec) for spec in interactive_specs]
        await asyncio.gather(*(task for _, task in [*batch, *interactive]))
    log = list(engine.scheduler.preemption_log)
    interactive_victims = [e for e in log if e.victim_class is INTERACTIVE]
    assert any(e.victim_class is BATCH for e in log) and interactive_victims, log
    assert not [e for e in log if e.victim_class is INTERACTIVE and e.for_class is BATCH]
    for event in interactive_victims:
        # A batch request still running once that step was scheduled would have given way first.
        running_then = watcher.record_of_step(event.step).running
        assert BATCH not in running_then.values(), (event, running_then)
    assert_all_blocks_free(engine)
