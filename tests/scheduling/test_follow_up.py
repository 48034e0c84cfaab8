"""A closed-loop client's next request starts in the step after its last one ended: the engine waits a
moment for it (scheduling/follow_up.py), only while such waits catch requests and within their share of
the engine's time."""

from __future__ import annotations

import asyncio

from benchmarks.fake_executors import FakeExecutor
from scheduling.engine import Engine
from scheduling.follow_up import FollowUpWait
from scheduling.request import PriorityClass
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import collect, make_geometry, make_request, running

CLIENT_WAY_BACK_S = 0.05  # the last token to the client, and its next request back to the engine


def engine_with(follow_up: FollowUpWait) -> Engine:
    executor = FakeExecutor(make_geometry(num_device_blocks=512, block_size=4))
    return Engine(Scheduler(SchedulerConfig(), executor.geometry), executor, follow_up=follow_up)


async def steps_between_turns(follow_up: FollowUpWait) -> int:
    """Another stream decoding throughout, one client's two turns: the steps from the one that ended its
    first request to the one that started its second."""
    engine = engine_with(follow_up)
    async with running(engine):
        other = engine.submit(make_request(8, 800))
        first = make_request(8, 3)
        await collect(engine.submit(first))
        await asyncio.sleep(CLIENT_WAY_BACK_S)  # the client's own time: it reads the answer and sends the next
        second = make_request(8, 3)
        await collect(engine.submit(second))
        engine.finish(other.request.request_id)
    assert isinstance(engine.executor, FakeExecutor)
    plans = engine.executor.plans
    ended = max(i for i, plan in enumerate(plans) if any(s.request_id == first.request_id for s in plan.sequences))
    started = min(i for i, plan in enumerate(plans) if any(s.request_id == second.request_id for s in plan.sequences))
    return started - ended


async def test_the_next_request_of_a_closed_loop_client_starts_in_the_step_after_its_last_ended() -> None:
    follow_up = FollowUpWait(wait_s=2.0)
    assert await steps_between_turns(follow_up) == 1
    assert (follow_up.counters.waits, follow_up.counters.caught) == (1, 1)
    assert CLIENT_WAY_BACK_S * 0.9 <= follow_up.counters.waited_s < 2.0  # it ended when the request came
    # Without the wait the other stream's steps went on meanwhile, and the request waited for one.
    assert await steps_between_turns(FollowUpWait(wait_s=0.0)) > 1


async def test_no_wait_after_a_batch_request_ends_nor_while_an_interactive_one_waits() -> None:
    follow_up = FollowUpWait(wait_s=2.0)
    executor = FakeExecutor(make_geometry(num_device_blocks=512, block_size=4))
    engine = Engine(Scheduler(SchedulerConfig(max_num_seqs=1), executor.geometry), executor, follow_up=follow_up)
    async with running(engine):
        await collect(engine.submit(make_request(8, 3, priority=PriorityClass.BATCH)))
        await collect(engine.submit(make_request(8, 3, priority=PriorityClass.BATCH)))  # would end a wait begun
        first, second = make_request(8, 3), make_request(8, 3)  # one sequence at a time: the second waits
        streams = [engine.submit(first), engine.submit(second)]
        await asyncio.gather(*(collect(stream) for stream in streams))
        assert follow_up.counters.waits == 0  # (the wait after the second's end is still on, never recorded)
    plans = executor.plans
    ended = max(i for i, plan in enumerate(plans) if any(s.request_id == first.request_id for s in plan.sequences))
    assert any(s.request_id == second.request_id for s in plans[ended + 1].sequences)


def test_waits_that_catch_nothing_are_taken_one_in_probe_every() -> None:
    follow_up = FollowUpWait(wait_s=0.003, min_hit_rate=0.3, probe_every=8, max_share=1.0)
    taken = 0
    for _ in range(200):
        follow_up.earn(1.0)
        if follow_up.should_wait():
            taken += 1
            follow_up.record(0.003, caught=False)
    assert follow_up.hit_rate < 0.3
    assert 200 / 8 - 2 <= taken <= 200 / 8 + 12  # the first dozen before the rate fell, then one in eight
    follow_up.record(0.003, caught=True)  # clients following up again: a few catches bring the waits back
    for _ in range(3):
        follow_up.record(0.003, caught=True)
    follow_up.earn(1.0)
    assert follow_up.should_wait()


def test_waits_take_at_most_their_share_of_the_engine_s_time() -> None:
    follow_up = FollowUpWait(wait_s=0.003, max_share=0.05)
    waited, busy = 0.0, 0.0
    for _ in range(1000):
        follow_up.earn(0.010)  # a 10 ms step, and an interactive request ends after each
        busy += 0.010
        if follow_up.should_wait():
            follow_up.record(0.003, caught=True)
            waited += 0.003
    assert waited <= 0.05 * busy + 4 * 0.003  # its share, and the budget it starts with
    assert waited >= 0.8 * 0.05 * busy
