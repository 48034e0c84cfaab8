"""The engine: one asyncio task owns the scheduler and runs steps while there is work.

HTTP handlers only call `submit()` and `abort()` and read their own stream. The forward runs in
one worker thread so the event loop stays free; an idle engine waits on an event and uses no CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from gpu.plan import StepPlan, StepResult
from scheduling.executor import Executor
from scheduling.request import Request, RequestId, RequestStatus, TokenEvent
from scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The bounded queue is full: the caller should answer 503 with Retry-After."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineObserver(Protocol):
    """Sees each request's progress, on the engine's task (keep it cheap: it runs every step)."""

    def on_tokens(self, request: Request, event: TokenEvent, now: float) -> None: ...

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None: ...


class RequestStream:
    """The token events of one request. Closing it before the end aborts the request."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self.request = request
        self._engine = engine
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.is_finished = False

    def push(self, event: TokenEvent) -> None:
        self._events.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while not self.is_finished:
            event = await self._events.get()
            self.is_finished = event.is_final
            yield event

    def take_ready(self) -> list[TokenEvent]:
        """The events already queued, without waiting: a reader that fell behind can send them as one."""
        ready: list[TokenEvent] = []
        while not self.is_finished and not self._events.empty():
            event = self._events.get_nowait()
            self.is_finished = event.is_final
            ready.append(event)
        return ready

    def close(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Stop the request unless it already ended (a client gone, or a stop string met)."""
        if not self.is_finished:
            self.is_finished = True
            self._engine.finish(self.request.request_id, status)


@dataclass(slots=True)
class EngineTimes:
    steps: int = 0
    busy_seconds: float = 0.0  # wall time of steps, scheduling and update included
    forward_seconds: float = 0.0  # inside the model forward
    swap_seconds: float = 0.0


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, max_queued_requests: int = 1024) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_queued_requests = max_queued_requests
        self.times = EngineTimes()
        self._streams: dict[RequestId, RequestStream] = {}
        self._incoming: list[Request] = []
        self._to_finish: list[tuple[RequestId, RequestStatus]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairlane-step")
        self._task: asyncio.Task[None] | None = None
        self._accepting = True
        self.observers: list[EngineObserver] = []

    # ---- the public surface ---------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fairlane-engine")

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; its events arrive on the returned stream. Raises when full or stopping."""
        if not self._accepting:
            raise EngineStopped("the server is shutting down")
        if len(self._streams) >= self.max_queued_requests:
            raise EngineOverloaded(f"the engine has {len(self._streams)} requests in flight")
        self.scheduler.check_admissible(request.num_prompt_tokens, request.max_tokens)
        stream = RequestStream(self, request)
        self._streams[request.request_id] = stream
        self._idle.clear()
        self._incoming.append(request)
        self._wake.set()
        return stream

    def finish(self, request_id: RequestId, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop) a request; takes effect before the next step."""
        self._to_finish.append((request_id, status))
        self._wake.set()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every request has ended; False if some are still going after timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return not self._streams

    async def shutdown(self, message: str = "the server is shutting down") -> None:
        """End every remaining request with an error, then stop the loop."""
        self._accepting = False
        self._apply_commands()
        self._dispatch(self.scheduler.fail_all(message))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        c = s.counters
        bytes_per_block = s.geometry.bytes_per_block
        return {
            "running": len(s.running),
            "waiting": sum(len(q) for q in s.waiting.values()) + len(self._incoming),
            "swapped": len(s.swapped),
            "kv_blocks_in_use": s.blocks.device.num_used,
            "kv_blocks_total": s.blocks.device.num_blocks,
            "cpu_blocks_in_use": s.blocks.cpu.num_used,
            "cpu_blocks_total": s.blocks.cpu.num_blocks,
            "requests_finished": c.num_finished,
            "requests_aborted": c.num_aborted,
            "preemptions": {"swap": c.preemptions["swap"], "recompute": c.preemptions["recompute"]},
            "swap": {
                "blocks_out": c.blocks_swapped_out, "blocks_in": c.blocks_swapped_in,
                "bytes_out": c.blocks_swapped_out * bytes_per_block,
                "bytes_in": c.blocks_swapped_in * bytes_per_block,
            },
            "by_class": {p.value: {"running": sum(r.priority is p for r in s.running),
                                   "waiting": len(s.waiting[p]),
                                   "swapped": sum(r.priority is p for r in s.swapped)} for p in s.waiting},
            "prefix_cache": {
                "queried_tokens": s.blocks.prefix_counters.queried_tokens,
                "hit_tokens": s.blocks.prefix_counters.hit_tokens,
                "cached_blocks": s.blocks.device.num_cached,
            },
            "tenants": s.tenant_stats(),
            "steps": self.times.steps,
            "forward_seconds": round(self.times.forward_seconds, 6),
            "busy_seconds": round(self.times.busy_seconds, 6),
        }

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._apply_commands()
            if not self.scheduler.has_work():
                self._wake.clear()
                continue
            started = time.perf_counter()
            plan = self.scheduler.schedule()
            try:
                result = await loop.run_in_executor(self._pool, self.executor.execute, plan)
            except Exception as exc:  # a failed step must not strand the requests in it
                logger.exception("engine step failed")
                self._dispatch(self.scheduler.fail_all(f"the engine failed: {type(exc).__name__}"))
                continue
            self._dispatch(self.scheduler.update(plan, result))
            self._account(plan, result, time.perf_counter() - started)

    def _apply_commands(self) -> None:
        incoming, self._incoming = self._incoming, []
        for request in incoming:
            self.scheduler.add_request(request)
        to_finish, self._to_finish = self._to_finish, []
        for request_id, status in to_finish:
            event = self.scheduler.finish_request(request_id, status)
            if event is not None:
                self._dispatch([event])

    def _dispatch(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.is_final:
                del self._streams[event.request_id]
                if not self._streams:
                    self._idle.set()
            stream.push(event)
            self._observe(stream.request, event, now)

    def _observe(self, request: Request, event: TokenEvent, now: float) -> None:
        if event.new_token_ids and request.first_token_time is None:
            request.first_token_time = now
        for observer in self.observers:
            if event.new_token_ids:
                observer.on_tokens(request, event, now)
            if event.is_final:
                observer.on_finished(request, event, now)

    def _account(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        self.times.steps += 1
        self.times.busy_seconds += seconds
        self.times.forward_seconds += result.forward_seconds
        self.times.swap_seconds += result.swap_seconds
