"""The scheduler through its public surface only: add_request, schedule, update, finish_request."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.fake_executors import FakeExecutor, fake_token, is_decode
from scheduling.preemption import PreemptionMode
from scheduling.request import Request, RequestId, RequestStatus
from scheduling.scheduler import AdmissionError, Scheduler, SchedulerConfig
from tests.factories import make_request, make_scheduler, run_step, run_to_completion


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def expected_output(request: Request, vocab_size: int = 320) -> list[int]:
    """What FakeExecutor produces for the request, however it is batched or preempted."""
    start = request.num_prompt_tokens
    return [fake_token(request.request_id, start + i, vocab_size) for i in range(request.max_tokens)]


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    assert scheduler.blocks.device.num_free == scheduler.blocks.device.num_blocks
    assert scheduler.blocks.cpu.num_free == scheduler.blocks.cpu.num_blocks
    assert not scheduler.has_work()


# ---- budgets ------------------------------------------------------------------------------


def test_token_budget_is_respected_and_used() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=16))
    executor = FakeExecutor(scheduler.geometry)
    requests = [make_request(30, max_tokens=5) for _ in range(6)]
    add(scheduler, *requests)
    events = run_to_completion(scheduler, executor)
    assert all(plan.num_tokens <= 16 for plan in executor.plans)
    assert any(plan.num_tokens == 16 for plan in executor.plans)
    for request in requests:
        assert [e.new_token_ids[0] for e in events[request.request_id]] == expected_output(request)
    assert_all_blocks_free(scheduler)


def test_sequence_cap_is_respected() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=3))
    executor = FakeExecutor(scheduler.geometry)
    requests = [make_request(6, max_tokens=4) for _ in range(10)]
    add(scheduler, *requests)
    max_running = 0
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        assert len(plan.sequences) <= 3
        max_running = max(max_running, len(plan.sequences))
    assert max_running == 3
    assert scheduler.counters.num_finished == 10
    assert_all_blocks_free(scheduler)


def test_decodes_go_before_prefill_chunks() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=16))
    executor = FakeExecutor(scheduler.geometry)
    short = [make_request(4, max_tokens=10) for _ in range(3)]
    add(scheduler, *short)
    first, _ = run_step(scheduler, executor)
    assert [len(seq.token_ids) for seq in first.sequences] == [4, 4, 4]

    long = make_request(40, max_tokens=2)
    add(scheduler, long)
    for step in range(2):
        plan, _ = run_step(scheduler, executor)
        decodes, chunk = plan.sequences[:3], plan.sequences[3]
        assert all(is_decode(seq) for seq in decodes)
        assert {seq.request_id for seq in decodes} == {r.request_id for r in short}
        # The prefill chunk gets what the decodes leave of the budget, wherever it stands.
        assert (chunk.request_id, chunk.start_position, len(chunk.token_ids)) == (long.request_id, 13 * step, 13)
        assert not chunk.needs_sample


def test_running_prefill_yields_to_decodes_when_the_budget_is_short() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=4))
    executor = FakeExecutor(scheduler.geometry)
    decoders = [make_request(1, max_tokens=8) for _ in range(3)]
    add(scheduler, *decoders)
    run_step(scheduler, executor)  # three one-token prompts, sampled
    long = make_request(20, max_tokens=1)
    add(scheduler, long)
    plan, _ = run_step(scheduler, executor)
    assert [len(seq.token_ids) for seq in plan.sequences] == [1, 1, 1, 1]
    assert plan.sequences[-1].request_id == long.request_id
    assert not plan.sequences[-1].needs_sample


def test_prefill_is_chunked_across_steps() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=8))
    executor = FakeExecutor(scheduler.geometry)
    request = make_request(20, max_tokens=3)
    add(scheduler, request)
    chunks = []
    for _ in range(3):
        plan, events = run_step(scheduler, executor)
        [seq] = plan.sequences
        chunks.append((seq.start_position, len(seq.token_ids), seq.needs_sample, len(events)))
        assert seq.token_ids == request.prompt_token_ids[seq.start_position:seq.start_position + len(seq.token_ids)]
    assert chunks == [(0, 8, False, 0), (8, 8, False, 0), (16, 4, True, 1)]
    assert request.num_computed_tokens == 20
    assert request.output_token_ids == expected_output(request)[:1]


# ---- order and preemption -----------------------------------------------------------------


def test_fcfs_admits_in_arrival_order_across_tenants() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=1, queue_policy="fcfs"))
    executor = FakeExecutor(scheduler.geometry)
    requests = [make_request(5, max_tokens=2, tenant_id=tenant) for tenant in ("a", "b", "a", "c", "b", "a")]
    add(scheduler, *requests)
    admitted: list[RequestId] = []
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        admitted.extend(RequestId(s.request_id) for s in plan.sequences if s.request_id not in admitted)
    assert admitted == [r.request_id for r in requests]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_newest_is_preempted_by_recompute_when_blocks_run_out(preemption_mode: str) -> None:
    # Six blocks of four tokens: three 8-token prompts fill them; the first decode needs a seventh.
    # With no CPU pool, swap falls back to recompute.
    scheduler = make_scheduler(SchedulerConfig(preemption_mode=preemption_mode), num_device_blocks=6)
    executor = FakeExecutor(scheduler.geometry)
    oldest, middle, newest = (make_request(8, max_tokens=6) for _ in range(3))
    add(scheduler, oldest, middle, newest)
    run_step(scheduler, executor)
    assert scheduler.blocks.device.num_free == 0

    plan, _ = run_step(scheduler, executor)
    assert [s.request_id for s in plan.sequences] == [oldest.request_id, middle.request_id]
    assert newest.status is RequestStatus.WAITING
    assert (newest.num_computed_tokens, newest.num_preemptions) == (0, 1)
    assert scheduler.blocks.block_table(newest.request_id) == ()
    [event] = scheduler.preemption_log
    assert (event.victim_id, event.mode) == (newest.request_id, PreemptionMode.RECOMPUTE)
    assert scheduler.counters.preemptions["recompute"] == 1

    events = run_to_completion(scheduler, executor)
    resumed = next(s for p in executor.plans[2:] for s in p.sequences if s.request_id == newest.request_id)
    # The resume prefills the prompt and the token sampled before the preemption, in one chunk.
    assert (resumed.start_position, len(resumed.token_ids), resumed.needs_sample) == (0, 9, True)
    for request in (oldest, middle, newest):
        assert request.output_token_ids == expected_output(request)
        assert events[request.request_id][-1].finish_reason == "length"
    assert_all_blocks_free(scheduler)


def test_swap_preemption_resumes_where_it_stopped() -> None:
    scheduler = make_scheduler(SchedulerConfig(preemption_mode="swap"), num_device_blocks=6, num_cpu_blocks=8)
    executor = FakeExecutor(scheduler.geometry)
    oldest, middle, newest = (make_request(8, max_tokens=6) for _ in range(3))
    add(scheduler, oldest, middle, newest)
    run_step(scheduler, executor)
    newest_blocks = scheduler.blocks.block_table(newest.request_id)
    plan, _ = run_step(scheduler, executor)
    assert newest.status is RequestStatus.SWAPPED
    assert tuple(device for device, _ in plan.swap_out) == newest_blocks
    assert scheduler.blocks.cpu_blocks(newest.request_id) == [cpu for _, cpu in plan.swap_out]
    assert newest.num_computed_tokens == 8  # the KV is kept, on the CPU
    assert scheduler.counters.preemptions["swap"] == 1

    run_to_completion(scheduler, executor)
    swap_in_step = next(i for i, p in enumerate(executor.plans) if p.swap_in)
    [resumed] = [s for s in executor.plans[swap_in_step].sequences if s.request_id == newest.request_id]
    assert (resumed.start_position, len(resumed.token_ids)) == (8, 1)  # only the token sampled before
    assert newest.output_token_ids == expected_output(newest)
    assert_all_blocks_free(scheduler)


# ---- finishing ----------------------------------------------------------------------------


def test_max_tokens_finishes_with_length() -> None:
    scheduler = make_scheduler()
    executor = FakeExecutor(scheduler.geometry)
    request = make_request(5, max_tokens=3)
    add(scheduler, request)
    events = run_to_completion(scheduler, executor)[request.request_id]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert events[-1].num_output_tokens == 3 and request.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.schedule().finished_request_ids == [request.request_id]  # the runner is told
    assert_all_blocks_free(scheduler)


def test_model_context_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=12)
    executor = FakeExecutor(scheduler.geometry)
    request = make_request(10, max_tokens=2)
    add(scheduler, request)
    events = run_to_completion(scheduler, executor)[request.request_id]
    assert events[-1].finish_reason == "length" and request.num_tokens == 12


def test_stop_token_finishes_with_stop() -> None:
    scheduler = make_scheduler()
    executor = FakeExecutor(scheduler.geometry)
    probe = make_request(6, max_tokens=10, request_id="stopper")
    outputs = expected_output(probe)
    stop = outputs[2]
    assert stop not in outputs[:2]
    request = make_request(probe.prompt_token_ids, max_tokens=10, request_id="stopper",
                           stop_token_ids=frozenset({stop}))
    add(scheduler, request)
    events = run_to_completion(scheduler, executor)[request.request_id]
    assert [e.finish_reason for e in events] == [None, None, "stop"]
    assert request.output_token_ids == outputs[:3]  # the stop token is part of the output
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert_all_blocks_free(scheduler)


def waiting_behind_another() -> tuple[Scheduler, FakeExecutor, Request]:
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=1, queue_order="fcfs"))
    executor = FakeExecutor(scheduler.geometry)
    first, second = make_request(4, max_tokens=20), make_request(8, max_tokens=4)
    add(scheduler, first, second)
    run_step(scheduler, executor)
    assert second.status is RequestStatus.WAITING
    return scheduler, executor, second


def prefilling() -> tuple[Scheduler, FakeExecutor, Request]:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=8))
    executor = FakeExecutor(scheduler.geometry)
    request = make_request(20, max_tokens=4)
    add(scheduler, request, make_request(3, max_tokens=6))
    run_step(scheduler, executor)
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    return scheduler, executor, request


def decoding() -> tuple[Scheduler, FakeExecutor, Request]:
    scheduler = make_scheduler()
    executor = FakeExecutor(scheduler.geometry)
    request = make_request(6, max_tokens=10)
    add(scheduler, request, make_request(3, max_tokens=6))
    run_step(scheduler, executor)
    run_step(scheduler, executor)
    assert request.num_output_tokens == 2
    return scheduler, executor, request


def swapped() -> tuple[Scheduler, FakeExecutor, Request]:
    scheduler = make_scheduler(SchedulerConfig(preemption_mode="swap"), num_device_blocks=6, num_cpu_blocks=8)
    executor = FakeExecutor(scheduler.geometry)
    requests = [make_request(8, max_tokens=6) for _ in range(3)]
    add(scheduler, *requests)
    run_step(scheduler, executor)
    run_step(scheduler, executor)
    assert requests[-1].status is RequestStatus.SWAPPED
    return scheduler, executor, requests[-1]


@pytest.mark.parametrize("stage", [waiting_behind_another, prefilling, decoding, swapped])
def test_finish_request_frees_blocks_at_every_stage(
        stage: Callable[[], tuple[Scheduler, FakeExecutor, Request]]) -> None:
    scheduler, executor, target = stage()
    event = scheduler.finish_request(target.request_id, RequestStatus.FINISHED_ABORTED)
    assert event is not None and event.finish_reason == "abort" and event.new_token_ids == ()
    assert target.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.blocks.block_table(target.request_id) == ()
    assert scheduler.blocks.cpu_blocks(target.request_id) == []
    assert scheduler.finish_request(target.request_id, RequestStatus.FINISHED_ABORTED) is None
    assert target.request_id in scheduler.schedule().finished_request_ids
    num_fed = sum(len(s.token_ids) for p in executor.plans for s in p.sequences if s.request_id == target.request_id)
    events = run_to_completion(scheduler, executor)
    assert target.request_id not in events
    assert num_fed == sum(len(s.token_ids) for p in executor.plans for s in p.sequences
                          if s.request_id == target.request_id)  # never scheduled again
    assert scheduler.counters.num_aborted == 1
    assert_all_blocks_free(scheduler)


# ---- admission ----------------------------------------------------------------------------


def test_request_longer_than_the_model_context_is_refused() -> None:
    scheduler = make_scheduler(max_model_len=64)
    scheduler.check_admissible(54, 10)  # exactly the context: fine
    with pytest.raises(AdmissionError, match="context of 64 tokens"):
        scheduler.check_admissible(60, 10)
    with pytest.raises(AdmissionError):
        scheduler.add_request(make_request(60, max_tokens=10))
    assert not scheduler.has_work()


def test_request_larger_than_the_kv_memory_is_refused() -> None:
    scheduler = make_scheduler(num_device_blocks=4, block_size=4)  # 16 tokens of KV in all
    scheduler.check_admissible(10, 6)
    with pytest.raises(AdmissionError, match="more KV memory"):
        scheduler.check_admissible(10, 7)
    with pytest.raises(AdmissionError):
        scheduler.add_request(make_request(10, max_tokens=7))
    assert not scheduler.has_work()
