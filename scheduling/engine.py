"""The engine: one asyncio task owns the scheduler and runs steps while there is work.

HTTP handlers only call `submit()` and `finish()` and read their own stream. The forward runs in
one worker thread so the event loop stays free; an idle engine waits on an event and uses no CPU.
`EngineFront` is what the app sees of any engine (the door, the streams, health); `Engine` runs the
steps in this process, and a cluster's ingress implements the same front over its replicas.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from contract.plan import CacheGeometry, StepPlan, StepResult
from scheduling.executor import Executor
from scheduling.follow_up import FollowUpWait
from scheduling.gc_pacing import PacedCollector
from scheduling.prefix_cache import prompt_block_hashes
from scheduling.request import PriorityClass, Request, RequestId, RequestStatus, TokenEvent, merged
from scheduling.scheduler import AdmissionError, Scheduler, check_admissible
from scheduling.snapshot import SchedulerSnapshot, SpeculationStats, StepCostStats
from tenancy.tenants import TenantRegistry

logger = logging.getLogger(__name__)

# After a step that could run nothing, the loop waits this long for a command before it plans again.
EMPTY_STEP_BACKOFF_S = 0.01
# The longest a stream holds tokens for its interval (RequestStream), told at the request's next event.
MAX_HOLD_S = 0.5


class EngineOverloaded(RuntimeError):
    """The bounded queue is full: the caller should answer 503 with Retry-After."""


class TenantOverShare(EngineOverloaded):
    """The queue is full and this tenant holds more than its weighted share of it: the caller should
    answer 429, as the tenant's own limits would, not 503, which would blame the server."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, or has failed, and takes no new requests."""


@dataclass(slots=True, frozen=True)
class EngineHealth:
    is_healthy: bool
    reason: str | None = None  # why not, for /health and the logs


def step_cost_stats(cost: StepCostStats) -> dict[str, Any]:
    """The step cost model and step shaping, for /stats."""
    return {"predicted_s": cost.predicted_s, "measured_s": cost.measured_s, "median_error": cost.median_error,
            "coefficients": None if cost.coefficients is None else dict(cost.coefficients),
            "shaped_steps": cost.shaped_steps, "batch_tokens_deferred": cost.batch_tokens_deferred,
            "itl_target_missed_steps": cost.itl_target_missed_steps,
            "long_prompt_tokens_deferred": cost.long_prompt_tokens_deferred}


def speculation_stats(stats: SpeculationStats | None) -> dict[str, Any] | None:
    """Speculative decoding's counts for /stats; None when it is off."""
    if stats is None:
        return None
    acceptance = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else None
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": acceptance,
            "accepted_per_position": list(stats.accepted_per_position),
            "by_tenant": {tenant: {"num_drafts": d, "num_draft_tokens": p, "num_accepted_tokens": a}
                          for tenant, (d, p, a) in sorted(stats.by_tenant.items())}}


def tenant_stats(snapshot: SchedulerSnapshot) -> dict[str, dict[str, object]]:
    """Per class: each tenant's VTC counter and queue length."""
    stats: dict[str, dict[str, object]] = {}
    for name, counters in snapshot.vtc.items():
        queued = snapshot.queued_by_tenant[name]
        tenants = sorted(set(queued) | set(counters))
        stats[name] = {t: {"vtc_counter": round(counters.get(t, 0.0), 3), "queued": queued.get(t, 0)} for t in tenants}
    return stats


class EngineObserver(Protocol):
    """Sees each request's progress, on the engine's task (keep it cheap: it runs every step)."""

    def on_tokens(self, request: Request, event: TokenEvent, now: float) -> None: ...

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None: ...


class RequestStream:
    """The token events of one request. Closing it before the end aborts the request.

    A request whose `stream_interval` is above 1 (batch-class streams by default, as vLLM's and SGLang's
    `--stream-interval`) has its events held until that many tokens are in, then sent as one event: its
    reader, and the SSE write and the client's read behind it, wake once for them all instead of at every
    step. Never held: the first tokens (the time to the first token is the client's to see), the end, and
    tokens held for MAX_HOLD_S (told at the next event: a stream whose steps are far apart is not held up
    for a whole interval of them)."""

    def __init__(self, engine: EngineFront, request: Request, clock: Callable[[], float] = time.monotonic) -> None:
        self.request = request
        self._engine = engine
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.is_finished = False
        self._clock = clock
        self._held: TokenEvent | None = None  # the events held so far, merged into one
        self._held_since = 0.0

    def push(self, event: TokenEvent) -> None:
        if self.request.stream_interval > 1:  # one check on the common path: the engine pushes every token
            paced = self._paced(event)
            if paced is None:
                return
            event = paced
        self._events.put_nowait(event)

    def _paced(self, event: TokenEvent) -> TokenEvent | None:
        """None while the event is held; else it, with the events held before it merged in. Held events are
        let go once MAX_HOLD_S has passed since the first of them was held."""
        held = self._held
        if held is None:
            if not self._may_hold(event):
                return event
            self._held, self._held_since = event, self._clock()
            return None
        event = merged(held, [event])
        if self._may_hold(event) and self._clock() - self._held_since < MAX_HOLD_S:
            self._held = event
            return None
        self._held = None
        return event

    def _may_hold(self, event: TokenEvent) -> bool:
        """Whether `event` (the held ones merged in) may be held: not the end, not the request's first tokens,
        not an interval's worth."""
        return not (event.is_final or event.num_output_tokens <= len(event.new_token_ids)
                    or len(event.new_token_ids) >= self.request.stream_interval)

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
    recompilations: int = 0  # compilations of the forward during serving (a step shape start-up did not compile)
    swap_seconds: float = 0.0


class EngineFront(abc.ABC):
    """What every engine the app serves through does alike, whoever runs its steps: the checks at the
    door (failure, shutdown, the queue's limit per class and weighted shares, context length and KV
    room), one stream per request, the observers, health, and the end of a failed loop. The app
    talks to this; `Engine` runs the steps here, and a cluster's ingress (cluster/remote_engine.py)
    has replicas run them."""

    def __init__(self, executor: Executor, geometry: CacheGeometry, tenants: TenantRegistry, *,
                 max_queued_requests: int = 1024, batch_queue_fraction: float = 0.75,
                 stall_after_s: float = 60.0) -> None:
        self.executor = executor  # what the app may ask of the runner besides steps (`check_structured`)
        self.geometry = geometry  # of the KV memory requests are checked against (the scheduler's)
        self.max_queued_requests = max_queued_requests
        self.batch_queue_fraction = batch_queue_fraction  # of the queue that batch-class requests may fill
        self.stall_after_s = stall_after_s
        self.failure: str | None = None  # set once when the loop dies; the engine then refuses everything
        self.on_failure: list[Callable[[str], None]] = []  # told once, on the event loop, when the loop dies
        self.observers: list[EngineObserver] = []
        self._tenants = tenants
        self._last_progress = time.monotonic()  # the end of the last step, or when work arrived at an idle engine
        self._in_flight_by_tenant: Counter[str] = Counter()
        self._streams: dict[RequestId, RequestStream] = {}
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._accepting = True
        self._ended_interactive = False  # an interactive request ended (stop or length) since the last step

    # ---- what each kind of engine does its own way ------------------------------------------

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def submit(self, request: Request) -> RequestStream:
        """Queue a request; its events arrive on the returned stream. Raises when full or stopping."""

    @abc.abstractmethod
    def finish(self, request_id: RequestId, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop) a request."""

    @abc.abstractmethod
    async def shutdown(self, message: str = "the server is shutting down") -> None:
        """End every remaining request with an error, then stop."""

    @property
    @abc.abstractmethod
    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler as /stats, /metrics and the dashboard may see it."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """/stats."""

    # ---- the door and the streams -------------------------------------------------------------

    def track(self, request: Request) -> RequestStream:
        """Check and register a request: its stream, its place in the queue's shares, the observers.
        Who runs it then (this process's scheduler, or a replica) is the subclass's `submit`; its
        events come to the stream through `deliver`."""
        if self.failure is not None:
            raise EngineStopped(f"the engine has failed: {self.failure}")
        if not self._accepting:
            raise EngineStopped("the server is shutting down")
        self._check_room(request.tenant_id, request.priority)
        check_admissible(self.geometry, request.num_prompt_tokens, request.max_tokens)
        stream = RequestStream(self, request)
        if not self._streams:
            self._last_progress = time.monotonic()  # an idle engine has not stalled
        self._streams[request.request_id] = stream
        self._in_flight_by_tenant[request.tenant_id] += 1
        self._idle.clear()
        return stream

    def deliver(self, events: list[TokenEvent]) -> None:
        """Events of tracked requests, to their streams and to the observers; events of requests no
        longer tracked are dropped."""
        now = time.monotonic()
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.is_final:
                if stream.request.priority is PriorityClass.INTERACTIVE and event.finish_reason in ("stop", "length"):
                    self._ended_interactive = True  # its client may send the next one at once (scheduling/follow_up.py)
                del self._streams[event.request_id]
                self._in_flight_by_tenant[stream.request.tenant_id] -= 1
                if not self._streams:
                    self._idle.set()
            stream.push(event)
            self._observe(stream.request, event, now)

    def _observe(self, request: Request, event: TokenEvent, now: float) -> None:
        if event.new_token_ids and request.first_token_time is None:
            request.first_token_time = now
        for observer in self.observers:
            try:
                if event.new_token_ids:
                    observer.on_tokens(request, event, now)
                if event.is_final:
                    observer.on_finished(request, event, now)
            except Exception:  # a metrics or quota bug must not stop the engine for everyone
                logger.exception("engine observer %s failed on %s", type(observer).__name__, request.request_id)

    def _check_room(self, tenant_id: str, priority: PriorityClass) -> None:
        """Batch-class work is shed first, and the queue is shared by weight, as the KV blocks are.

        Each class may fill the queue up to its own limit (`queue_limit`), counting the requests of
        both classes: interactive requests all of `max_queued_requests`, batch ones only
        `batch_queue_fraction` of it. So as the queue nears full, new batch requests are refused
        while interactive ones still find the rest of the room.

        Below its class's limit anyone may come in (an idle tenant's share is borrowed). At or past
        it, a tenant under its weighted share of that limit still gets in (so one tenant's flood
        never turns into another's 503, and the queue holds at most twice its size), and one over it
        gets TenantOverShare (or EngineOverloaded when it is the only tenant in flight)."""
        limit = self.queue_limit(priority)
        if len(self._streams) < limit:
            return
        held = self._in_flight_by_tenant[tenant_id]
        if held < self.queue_share(tenant_id, priority):
            return
        fill = f"{len(self._streams)} requests in flight, {priority.value}-class requests may fill {limit}"
        if held == len(self._streams):  # nobody else is waiting: the server, not a neighbour, is full
            raise EngineOverloaded(f"the engine has {fill}")
        raise TenantOverShare(f"the engine has {fill}, and this tenant holds {held} of them, "
                              "its weighted share or more")

    def queue_limit(self, priority: PriorityClass) -> int:
        """How full the queue may get with requests of the class still let in (at least one)."""
        if priority is PriorityClass.INTERACTIVE:
            return self.max_queued_requests
        return max(1, math.ceil(self.max_queued_requests * self.batch_queue_fraction))

    def queue_share(self, tenant_id: str, priority: PriorityClass = PriorityClass.INTERACTIVE) -> float:
        """The tenant's weighted share of the class's queue limit, among the tenants with requests in
        flight and itself."""
        tenants = self._tenants
        active = {t for t, n in self._in_flight_by_tenant.items() if n > 0} | {tenant_id}
        total_weight = sum(tenants.weight(t) for t in active)
        return self.queue_limit(priority) * tenants.weight(tenant_id) / total_weight

    def health(self) -> EngineHealth:
        """Unhealthy once the loop has died, or while work waits and no step has ended for stall_after_s."""
        if self.failure is not None:
            return EngineHealth(False, f"the engine failed: {self.failure}")
        stalled_s = time.monotonic() - self._last_progress
        if self._streams and stalled_s > self.stall_after_s:
            return EngineHealth(False, f"the engine has not finished a step for {stalled_s:.0f} s "
                                       f"with {len(self._streams)} requests in flight")
        return EngineHealth(True)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every request has ended; False if some are still going after timeout."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        return not self._streams

    @property
    def tenants(self) -> TenantRegistry:
        """The tenants the engine serves (configuration, not scheduler state)."""
        return self._tenants

    def _fail_loudly(self, reason: str) -> None:
        """End every in-flight stream with an error without asking the scheduler, whose state may be
        what broke."""
        self.failure = reason
        self._accepting = False
        streams, self._streams = self._streams, {}
        self._in_flight_by_tenant.clear()
        for stream in streams.values():
            request = stream.request
            stream.push(TokenEvent(request.request_id, (), "error", request.num_prompt_tokens,
                                   request.num_output_tokens, request.num_cached_tokens,
                                   f"the engine failed: {reason}"))
        self._idle.set()
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:
                logger.exception("an engine failure callback failed")


class Engine(EngineFront):
    """The engine of one process: its one asyncio task owns the scheduler and runs steps while there is
    work; every change to the scheduler is a command that task applies."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *, max_queued_requests: int = 1024,
                 batch_queue_fraction: float = 0.75, stall_after_s: float = 60.0,
                 step_thread: ThreadPoolExecutor | None = None, calibrate: bool = False,
                 follow_up: FollowUpWait | None = None) -> None:
        super().__init__(executor, scheduler.geometry, scheduler.tenants, max_queued_requests=max_queued_requests,
                         batch_queue_fraction=batch_queue_fraction, stall_after_s=stall_after_s)
        self.scheduler = scheduler
        self.follow_up = follow_up or FollowUpWait()  # off unless asked (scheduling/follow_up.py)
        self._snapshot = scheduler.snapshot()
        # What the engine reads of the scheduler's configuration, once: after this only its task touches it.
        self._hash_block_size = scheduler.geometry.block_size if scheduler.config.enable_prefix_caching else None
        self.times = EngineTimes()
        self.collector = PacedCollector()
        # Timed steps that fit the step cost model (scheduling/calibration.py): before the first step, and
        # after the runner changes its forward. Off for fake executors whose virtual clocks tests read.
        self._calibrate = calibrate
        self._needs_calibration = calibrate
        self._lone_decode_timed = False  # since the forward last changed (see _step)
        self._incoming: list[Request] = []
        self._to_finish: list[tuple[RequestId, RequestStatus]] = []
        self._to_fold: list[Mapping[str, Mapping[str, float]]] = []
        # The KV hand-off of disaggregated serving (cluster/handoff.py): host blocks to hold for blocks
        # another replica computed, and those filled (or not), applied before the requests that follow.
        self._to_hold: list[tuple[tuple[bytes, ...], asyncio.Future[list[tuple[bytes, int]]]]] = []
        self._to_release: list[tuple[list[bytes], list[bytes]]] = []
        self._wake = asyncio.Event()
        self._command_arrived = asyncio.Event()  # set with each command; cleared as a step applies them
        # The one thread that runs the executor's steps; the engine owns it from here on. A real runner
        # should have been built on it too (see app.process.engine_factory.build_engine).
        self._pool = step_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairlane-step")
        self._task: asyncio.Task[None] | None = None

    # ---- the public surface ---------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fairlane-engine")

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; its events arrive on the returned stream. Raises when full or stopping.
        The prompt's block hashes are made here, on the caller's side of the queue (in the server, an
        HTTP handler, while the runner's thread computes a step): a step then never spends its time
        hashing the prompts it admits, which for a long prompt would hold every other stream's token."""
        if request.adapter is not None and not self.scheduler.config.max_loras:  # refused here, not in the loop
            raise AdmissionError(f"LoRA adapter '{request.adapter.name}' asked of an engine without LoRA slots")
        stream = self.track(request)
        if self._hash_block_size is not None and not request.prompt_block_hashes:  # a cluster's ingress hashed it
            request.prompt_block_hashes = prompt_block_hashes(request.prompt_token_ids, self._hash_block_size,
                                                              request.cache_salt)
        self._incoming.append(request)
        self._command()
        return stream

    def finish(self, request_id: RequestId, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop) a request; takes effect before the next step."""
        self._to_finish.append((request_id, status))
        self._command()

    def fold_service(self, service: Mapping[str, Mapping[str, float]]) -> None:
        """Service other replicas gave, per class name and tenant, for this engine's VTC counters
        (`Scheduler.fold_service`); applied by the engine's task before its next step."""
        self._to_fold.append(service)
        self._command()

    async def hold_for_import(self, chain: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Host blocks to fill with the blocks of a prompt's hash chain that another replica computed
        (`Scheduler.hold_for_import`), held by the engine's task between two steps; fill them, then
        `release_imports`. Empty without a host tier. A loop that has died never answers: the caller bounds
        the wait (cluster.handoff.receive_blocks)."""
        future: asyncio.Future[list[tuple[bytes, int]]] = asyncio.get_running_loop().create_future()
        self._to_hold.append((tuple(chain), future))
        self._command()
        return await future

    def release_imports(self, filled: Sequence[bytes], failed: Sequence[bytes]) -> None:
        """Held host blocks filled (a request submitted after this finds them) or not (dropped)."""
        self._to_release.append((list(filled), list(failed)))
        self._command()

    async def shutdown(self, message: str = "the server is shutting down") -> None:
        """End every remaining request with an error, then stop the loop."""
        self._accepting = False
        self._apply_commands()
        self.deliver(self.scheduler.fail_all(message))
        self._snapshot = self.scheduler.snapshot()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._pool.shutdown(wait=True)
        close = getattr(self.executor, "close", None)  # a runner's disk tier finishes its writes
        if close is not None:
            close()

    @property
    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler as of the end of the last step, or of the last commands applied."""
        return self._snapshot

    def stats(self) -> dict[str, Any]:
        """/stats: the snapshot, the requests not yet handed to the scheduler, and the step times."""
        s = self._snapshot
        return {
            "running": s.running,
            "waiting": s.waiting + len(self._incoming),
            "swapped": s.swapped,
            "kv_blocks_in_use": s.kv_blocks.used,
            "kv_blocks_total": s.kv_blocks.total,
            "cpu_blocks_in_use": s.cpu_blocks.used,
            "cpu_blocks_total": s.cpu_blocks.total,
            "requests_finished": s.num_finished,
            "requests_aborted": s.num_aborted,
            "preemptions": dict(s.preemptions),
            "swap": {
                "blocks_out": s.blocks_swapped_out, "blocks_in": s.blocks_swapped_in,
                "bytes_out": s.blocks_swapped_out * s.bytes_per_block,
                "bytes_in": s.blocks_swapped_in * s.bytes_per_block,
            },
            "by_class": {name: {"running": load.running, "waiting": load.waiting, "swapped": load.swapped}
                         for name, load in s.by_class.items()},
            "prefix_cache": {"queried_tokens": s.prefix_queried_tokens, "hit_tokens": s.prefix_hit_tokens,
                             "cached_blocks": s.cached_blocks,
                             "tiers": {name: {"blocks": t.blocks, "capacity_blocks": t.capacity,
                                              "bytes": t.blocks * s.bytes_per_block, "hits": t.hits,
                                              "writes": t.writes, "evictions": t.evictions, "lost": t.lost}
                                       for name, t in s.tiers.items()}},
            "tenants": tenant_stats(s),
            "step_cost": step_cost_stats(s.step_cost),
            "output_lengths": {"rank_correlation": s.output_length_rank_correlation},
            "speculation": speculation_stats(s.speculation),
            "steps": self.times.steps,
            "forward_seconds": round(self.times.forward_seconds, 6),
            "forward_recompilations": self.times.recompilations,
            "busy_seconds": round(self.times.busy_seconds, 6),
            "paced_gc": {"collections_by_generation": list(self.collector.collections),
                         "seconds": round(self.collector.seconds, 6)},
            "follow_up_waits": {"waits": self.follow_up.counters.waits, "caught": self.follow_up.counters.caught,
                                "seconds": round(self.follow_up.counters.waited_s, 6),
                                "hit_rate": round(self.follow_up.hit_rate, 3)},
        }

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        """Steps while there is work. Supervised: a failure of the scheduler or the engine's own code
        (anything but the executor, whose failures end only the requests of that step) kills the
        loop loudly: every in-flight request gets an error, `failure` is set, and `on_failure`
        callbacks run (the server then answers 503 and exits non-zero)."""
        try:
            while True:
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("the engine loop failed")
            self._fail_loudly(f"{type(exc).__name__}: {exc}")

    def _command(self) -> None:
        self._wake.set()
        self._command_arrived.set()

    async def _step(self) -> None:
        if self._needs_calibration and self._may_calibrate():
            await self._run_calibration()
        elif self._needs_calibration and self._may_time_lone_decode():
            # Busy since the forward changed: the step shaper's targets are multiples of a lone decode, which
            # a loaded server may not serve for minutes. Two decode steps now; the rest waits for an idle engine.
            self._lone_decode_timed = True
            await self._run_calibration(lone_decode_only=True)
        await self._wake.wait()
        self._command_arrived.clear()
        self._apply_commands()
        if not self.scheduler.has_work() and not self.scheduler.has_untold_finishes:
            self._wake.clear()
            return
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        try:
            computing = asyncio.get_running_loop().run_in_executor(self._pool, self.executor.execute, plan)
            self.collector.collect_due()  # while the runner's thread computes the step (see gc_pacing.py)
            result = await computing
        except Exception as exc:  # a failed step must not strand the requests in it
            logger.exception("engine step failed")
            self.deliver(self.scheduler.fail_all(f"the engine failed: {type(exc).__name__}"))
            self._snapshot = self.scheduler.snapshot()
            return
        self.deliver(self.scheduler.update(plan, result))
        if self._calibrate and result.forward_changed:
            self._needs_calibration, self._lone_decode_timed = True, False
        seconds = time.perf_counter() - started
        self.scheduler.observe_step_time(plan, seconds)
        self._snapshot = self.scheduler.snapshot()
        self._account(plan, result, seconds)
        self.follow_up.earn(seconds)
        if plan.is_empty:
            await self._wait_for_a_command(EMPTY_STEP_BACKOFF_S)
        elif self._ended_interactive:
            await self._wait_for_follow_up()

    async def _wait_for_follow_up(self) -> None:
        """After a step that ended an interactive request: a moment for its client's next request, so that it
        starts in the next step (scheduling/follow_up.py). Not while a request already waits for that step."""
        self._ended_interactive = False
        if self._incoming or len(self.scheduler.waiting[PriorityClass.INTERACTIVE]) or not self.follow_up.should_wait():
            return
        started = time.perf_counter()
        await self._wait_for_a_command(self.follow_up.wait_s)
        caught = any(request.priority is PriorityClass.INTERACTIVE for request in self._incoming)
        self.follow_up.record(time.perf_counter() - started, caught)

    def _may_calibrate(self) -> bool:
        """Calibration waits for an idle engine (no request waits on it; served steps teach the model
        meanwhile) and for the forward that will serve: not while a compiled one is on its way, whose
        first step (forward_changed) asks for calibration again."""
        return not self.scheduler.has_work() and not getattr(self.executor, "awaits_compiled_forward", False)

    def _may_time_lone_decode(self) -> bool:
        return (not self._lone_decode_timed and self.scheduler.lacks_lone_decode
                and not getattr(self.executor, "awaits_compiled_forward", False))

    async def _run_calibration(self, lone_decode_only: bool = False) -> None:
        """The calibration steps (or only the lone decode's), each timed as the executor runs it. A failed one
        ends calibration: the cost model then learns from the steps served, as it would without."""
        if not lone_decode_only:
            self._needs_calibration = False  # a lone decode alone leaves the rest for an idle engine
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        steps = self.scheduler.calibration_steps(lone_decode_only)
        try:
            for plan in steps:
                step_started = time.perf_counter()
                await loop.run_in_executor(self._pool, self.executor.execute, plan)
                self.scheduler.observe_calibration(plan, time.perf_counter() - step_started)
        except Exception:
            logger.exception("a calibration step failed; the step cost model learns from served steps only")
        finally:
            steps.close()
            self._snapshot = self.scheduler.snapshot()
        logger.info("step cost model calibrated%s in %.2f s", " (a lone decode)" if lone_decode_only else "",
                    time.perf_counter() - started)

    async def _wait_for_a_command(self, timeout_s: float) -> None:
        """After a step that could run nothing, wait for a command (a request, an abort) or a short
        while (time alone changes little: a pin's TTL, the step-cost model) before planning again. A
        loop that planned again at once would spin the runner's thread on empty steps, thousands a
        second, for as long as a request waits on something no step can give it."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel (shutdown's) that comes
        # as a command arrives, and the engine's task would step on.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._command_arrived.wait()

    def _apply_commands(self) -> None:
        to_hold, self._to_hold = self._to_hold, []
        for chain, future in to_hold:
            if not future.done():
                future.set_result(self.scheduler.hold_for_import(chain))
        to_release, self._to_release = self._to_release, []
        for filled, failed in to_release:
            self.scheduler.release_imports(filled, failed)
        incoming, self._incoming = self._incoming, []
        for request in incoming:
            self.scheduler.add_request(request)
        to_finish, self._to_finish = self._to_finish, []
        for request_id, status in to_finish:
            event = self.scheduler.finish_request(request_id, status)
            if event is not None:
                self.deliver([event])
        to_fold, self._to_fold = self._to_fold, []
        for service in to_fold:
            self.scheduler.fold_service(service)
        if incoming or to_finish or to_fold:
            self._snapshot = self.scheduler.snapshot()

    def _account(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        self._last_progress = time.monotonic()
        self.times.steps += 1
        self.times.busy_seconds += seconds
        self.times.forward_seconds += result.forward_seconds
        self.times.recompilations += result.recompilations
        self.times.swap_seconds += result.swap_seconds
