"""Factories for requests, schedulers and engines, and the helpers that drive them in tests."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import torch

from benchmarks.fake_executors import FakeExecutor, RecordingExecutor, is_decode
from contract.plan import CacheGeometry, SamplingParams, StepPlan
from gpu.models import LoadedModel
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine, RequestStream
from scheduling.executor import Executor
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import TenantId, TenantRegistry

_request_numbers = itertools.count()


class _ArrivalClock:
    """time.monotonic(), nudged so that no two requests made here ever arrive at the same instant."""

    def __init__(self) -> None:
        self._last = 0.0

    def tick(self) -> float:
        self._last = max(time.monotonic(), self._last + 1e-6)
        return self._last


_arrivals = _ArrivalClock()


class VirtualClock:
    """A clock that moves only when a test moves it: a scheduler's, in simulations of step times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt_tokens(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of byte tokens (valid for every vocabulary used in the tests)."""
    return [(salt * 37 + i * 11 + 3) % 256 for i in range(length)]


def make_request(
    prompt: Sequence[int] | int = 8,
    max_tokens: int = 4,
    *,
    request_id: str | None = None,
    sampling: SamplingParams | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    tenant_id: str = "default",
    priority: PriorityClass = PriorityClass.INTERACTIVE,
    arrival_time: float | None = None,
) -> Request:
    """A request; an int prompt means that many deterministic tokens. Arrival times are monotonic
    clock readings that strictly increase in creation order, so "the newest" is never a tie."""
    number = next(_request_numbers)
    tokens = prompt_tokens(prompt, salt=number) if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id=RequestId(request_id if request_id is not None else f"req-{number}"),
        prompt_token_ids=tokens,
        max_tokens=max_tokens,
        sampling=sampling or SamplingParams(),
        stop_token_ids=stop_token_ids,
        tenant_id=TenantId(tenant_id),
        priority=priority,
        arrival_time=arrival_time if arrival_time is not None else _arrivals.tick(),
    )


def make_geometry(num_device_blocks: int = 64, num_cpu_blocks: int = 0, block_size: int = 4,
                  max_model_len: int = 1024, bytes_per_block: int = 1024) -> CacheGeometry:
    return CacheGeometry(num_device_blocks, num_cpu_blocks, block_size, bytes_per_block, max_model_len)


def make_scheduler(config: SchedulerConfig | None = None, *, num_device_blocks: int = 64, num_cpu_blocks: int = 0,
                   block_size: int = 4, max_model_len: int = 1024, tenants: TenantRegistry | None = None
                   ) -> Scheduler:
    """A scheduler over a made-up cache geometry (pair it with FakeExecutor(scheduler.geometry))."""
    geometry = make_geometry(num_device_blocks, num_cpu_blocks, block_size, max_model_len)
    return Scheduler(config or SchedulerConfig(), geometry, tenants)


def run_step(scheduler: Scheduler, executor: Executor) -> tuple[StepPlan, list[TokenEvent]]:
    """One engine step by hand: schedule, execute, update."""
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, executor.execute(plan))


def run_to_completion(scheduler: Scheduler, executor: Executor, max_steps: int = 10_000
                      ) -> dict[RequestId, list[TokenEvent]]:
    """Step until the scheduler has no work; every event, grouped by request."""
    events: dict[RequestId, list[TokenEvent]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return events
        _, step_events = run_step(scheduler, executor)
        for event in step_events:
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError(f"the scheduler still had work after {max_steps} steps")


def make_runner(loaded: LoadedModel, *, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                max_model_len: int | None = None, seed: int = 0, kv_dtype: torch.dtype | None = None) -> ModelRunner:
    """A runner whose KV pools hold exactly num_blocks device blocks and num_cpu_blocks CPU blocks."""
    bytes_per_block = kv_shape_of(loaded, block_size, kv_dtype).bytes_per_block
    budget = RunnerBudget(block_size=block_size, kv_cache_bytes=num_blocks * bytes_per_block,
                          swap_space_bytes=num_cpu_blocks * bytes_per_block, max_model_len=max_model_len,
                          seed=seed, kv_cache_dtype=kv_dtype)
    return ModelRunner(loaded, budget)


def make_engine(loaded: LoadedModel, *, num_blocks: int = 256, block_size: int = 16, num_cpu_blocks: int = 0,
                config: SchedulerConfig | None = None, max_queued_requests: int = 1024,
                seed: int = 0, kv_dtype: torch.dtype | None = None) -> Engine:
    """An engine (not started) over a real runner for `loaded`, its executor a RecordingExecutor."""
    runner = make_runner(loaded, num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks,
                         seed=seed, kv_dtype=kv_dtype)
    executor = RecordingExecutor(runner)
    scheduler = Scheduler(config or SchedulerConfig(), executor.geometry)
    return Engine(scheduler, executor, max_queued_requests=max_queued_requests)


def make_fake_engine(*, num_blocks: int = 256, block_size: int = 4, config: SchedulerConfig | None = None,
                     max_queued_requests: int = 1024, executor: Executor | None = None) -> Engine:
    """An engine (not started) over a FakeExecutor, or the given executor."""
    executor = executor or FakeExecutor(make_geometry(num_device_blocks=num_blocks, block_size=block_size))
    scheduler = Scheduler(config or SchedulerConfig(), executor.geometry)
    return Engine(scheduler, executor, max_queued_requests=max_queued_requests)


def plans_of(engine: Engine) -> list[StepPlan]:
    """The plans the engine's executor ran (for engines built by the factories above)."""
    executor = engine.executor
    if isinstance(executor, RecordingExecutor | FakeExecutor):
        return executor.plans
    raise TypeError(f"{type(executor).__name__} keeps no plans")


def has_mixed_step(plans: Sequence[StepPlan]) -> bool:
    """Some step ran a decode and a multi-token prefill chunk together."""
    return any(
        any(is_decode(seq) for seq in plan.sequences) and any(len(seq.token_ids) > 1 for seq in plan.sequences)
        for plan in plans
    )


def has_split_prefill(plans: Sequence[StepPlan]) -> bool:
    """Some prompt was fed in more than one chunk: a chunk that stops short of the known tokens."""
    return any(not seq.needs_sample for plan in plans for seq in plan.sequences)


@asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[Engine]:
    """Start the engine's loop; always shut it down, whatever the test did."""
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


STEP_POLL_S = 0.0002  # shorter than any step, long enough for the loop to block and let the runner run


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.001,
                     what: str = "the condition") -> None:
    """Poll predicate on the event loop until it holds; fail the test after timeout seconds.
    interval 0 polls every STEP_POLL_S, so no engine step goes by unobserved: the loop checks while each
    step computes. Not `sleep(0)`: a loop that never blocks takes the GIL back from the runner's thread
    after each operator it runs, and on a 2-vCPU VM whose thread wake-ups are slow builtin:tiny's steps
    took 2-2.5 s each instead of 20 ms (each operator waited out the switch interval)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval or STEP_POLL_S)


async def collect(stream: RequestStream, timeout: float = 60.0) -> list[TokenEvent]:
    """Every event of the stream up to and including the final one."""
    events: list[TokenEvent] = []
    async with asyncio.timeout(timeout):
        async for event in stream:
            events.append(event)
    return events


def tokens_of(events: Sequence[TokenEvent]) -> list[int]:
    return [token for event in events for token in event.new_token_ids]


def assert_kv_all_free(engine: Engine) -> None:
    """No request holds a device or CPU block."""
    stats = engine.stats()
    blocks = engine.scheduler.blocks
    assert stats["kv_blocks_in_use"] == 0, stats
    assert blocks.device.num_free == blocks.device.num_blocks
    assert blocks.cpu.num_free == blocks.cpu.num_blocks
    assert not engine.scheduler.requests  # every request ended
