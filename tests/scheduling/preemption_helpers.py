"""Engines on a real runner with a KV budget small enough to force preemption, and the checks the
preemption tests share: reference outputs, block accounting, who was running when a victim fell."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.fake_executors import DelegatingExecutor
from contract.plan import StepPlan, StepResult
from gpu.models import LoadedModel
from scheduling.engine import Engine, RequestStream
from scheduling.executor import Executor
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import collect, make_request, make_runner, running, tokens_of

BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """A request to build afresh for each engine (a submitted request is the engine's to mutate)."""

    request_id: str
    prompt: int  # that many deterministic byte tokens, different for each salt
    max_tokens: int
    priority: PriorityClass
    salt: int

    def build(self) -> Request:
        tokens = [(self.salt * 53 + i * 7 + 5) % 256 for i in range(self.prompt)]
        return make_request(tokens, self.max_tokens, request_id=self.request_id, priority=self.priority)


def specs(prefix: str, priority: PriorityClass, lengths: Sequence[tuple[int, int]], salt: int = 0
          ) -> list[RequestSpec]:
    """One spec per (prompt length, max_tokens) pair, ids prefix0, prefix1, ..."""
    return [RequestSpec(f"{prefix}{i}", prompt, max_tokens, priority, salt + i)
            for i, (prompt, max_tokens) in enumerate(lengths)]


@dataclass(slots=True)
class StepRecord:
    """One executed step: its plan, and the class of every request running once it was scheduled."""

    plan: StepPlan
    running: dict[RequestId, PriorityClass]


@dataclass(slots=True)
class WatchingExecutor(DelegatingExecutor):
    """Delegates to the runner and records each step. The engine awaits the step, so the scheduler
    is not changing while `execute` reads it; records[k] is the step the scheduler numbered k + 1."""

    inner: Executor
    scheduler: Scheduler | None = None
    records: list[StepRecord] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        assert self.scheduler is not None
        self.records.append(StepRecord(plan, {r.request_id: r.priority for r in self.scheduler.running}))
        return self.inner.execute(plan)

    def record_of_step(self, step: int) -> StepRecord:
        return self.records[step - 1]


def build_engine(loaded: LoadedModel, *, num_blocks: int, num_cpu_blocks: int = 64, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, preemption_mode: str = "swap") -> tuple[Engine, WatchingExecutor]:
    """An engine (not started) whose device pool holds num_blocks blocks of BLOCK_SIZE tokens."""
    runner = make_runner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_cpu_blocks=num_cpu_blocks)
    watcher = WatchingExecutor(runner)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             preemption_mode=preemption_mode)
    scheduler = Scheduler(config, watcher.geometry)
    watcher.scheduler = scheduler
    return Engine(scheduler, watcher), watcher


async def reference_outputs(loaded: LoadedModel, all_specs: Sequence[RequestSpec]) -> dict[str, list[int]]:
    """Each request's greedy tokens on an engine with room for all of them at once: never preempted."""
    engine, _ = build_engine(loaded, num_blocks=256, num_cpu_blocks=0, max_num_seqs=64)
    async with running(engine):
        streams = {spec.request_id: engine.submit(spec.build()) for spec in all_specs}
        events = await asyncio.gather(*(collect(stream) for stream in streams.values()))
        assert not engine.scheduler.preemption_log
    return {request_id: tokens_of(e) for request_id, e in zip(streams, events, strict=True)}


def submit(engine: Engine, spec: RequestSpec) -> tuple[Request, asyncio.Task[list[TokenEvent]]]:
    """Submit a fresh request of spec; a task collects its events."""
    request = spec.build()
    stream: RequestStream = engine.submit(request)
    return request, asyncio.create_task(collect(stream))


def assert_all_blocks_free(engine: Engine) -> None:
    """No request is left and no device or CPU block is held."""
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.swapped
    assert all(len(queue) == 0 for queue in scheduler.waiting.values())
    assert scheduler.blocks.device.num_free == scheduler.blocks.device.num_blocks
    assert scheduler.blocks.cpu.num_free == scheduler.blocks.cpu.num_blocks
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["cpu_blocks_in_use"] == 0, stats
