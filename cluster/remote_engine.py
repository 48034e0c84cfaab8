"""The ingress's engine: the HTTP layer's Engine, whose requests run on the replicas.

The app's routes, quotas, metrics and SSE code stay exactly as in the single server: they talk to an
Engine. This one checks and tracks each request like any engine (queue share, context length,
observers), then streams it from a replica through Ray Serve's streaming handle and delivers the
replica's events as its own. Closing a request's stream cancels the replica call, which aborts it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from app.observability.metrics import ReplicaState
from cluster.handoff import continuation, ends_at_prefill, going_on, may_hand_off, prefill_request, with_cached_tokens
from cluster.wire import HandoffNote, ReplicaCall, ReplicaReport, replica_call
from cluster.wire import ended_event as ended
from contract.plan import CacheGeometry, StepPlan, StepResult, StructuredOutput
from scheduling.engine import EngineFront, EngineHealth, RequestStream
from scheduling.request import Request, RequestId, RequestStatus, TokenEvent, finish_reason
from scheduling.snapshot import SchedulerSnapshot, idle_snapshot
from tenancy.tenants import TenantRegistry

logger = logging.getLogger(__name__)

# Disaggregated: decode replicas a request may go through (one lost mid-way, then another).
DECODE_ATTEMPTS = 2

# /stats keys that add up across replicas.
SUMMED_STATS = ("running", "waiting", "swapped", "kv_blocks_in_use", "kv_blocks_total", "cpu_blocks_in_use",
                "cpu_blocks_total", "requests_finished", "requests_aborted", "steps")


def as_the_requests(events: list[TokenEvent], request_id: RequestId, num_cached_tokens: int | None
                    ) -> list[TokenEvent]:
    """A replica's events as the ingress's request's: under its id (a continuation on another replica
    runs under one of its own), with the prompt's cached tokens as the prefill replica counted them."""
    if num_cached_tokens is None and events[0].request_id == request_id:
        return events
    events = [event._replace(request_id=request_id) for event in events]
    return events if num_cached_tokens is None else [with_cached_tokens(event, num_cached_tokens) for event in events]


class RemoteExecutor:
    """What the ingress knows of the replicas' runners: their KV geometry (for the admission checks)
    and their grammar check. Steps never run here."""

    def __init__(self, geometry: CacheGeometry, check: Callable[[StructuredOutput], None]) -> None:
        self._geometry = geometry
        self._check = check

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def execute(self, plan: StepPlan) -> StepResult:
        raise RuntimeError("the ingress runs no steps: its requests run on the replicas")

    def check_structured(self, structured: StructuredOutput) -> None:
        """Called in a worker thread by the routes; asks one replica (ValueError for a bad grammar)."""
        self._check(structured)


@dataclass(slots=True)
class RemoteRun:
    call: ReplicaCall
    task: asyncio.Task[None] | None = None
    last: TokenEvent | None = None  # the latest event from its replica, for the counts of an early end
    output_token_ids: list[int] = field(default_factory=list)  # delivered so far: what a replica continues from
    publish_seconds: float | None = None  # disaggregated: the prefill replica's wait for its writes


@dataclass(slots=True)
class BoardView:
    """The replicas' latest reports, as the ingress last read them from the board."""

    reports: list[ReplicaReport] = field(default_factory=list)
    read_at: float | None = None  # time.monotonic() of the last successful read


class ClusterEngine(EngineFront):
    """The front of an engine whose steps run on the replicas: no scheduler here. It checks requests
    against the replicas' geometry and tenants, and its snapshot is an idle one: the replicas' own
    come from the board (`replica_snapshots`)."""

    def __init__(self, executor: RemoteExecutor, tenants: TenantRegistry, generate: Any, board: Any, *,
                 max_queued_requests: int, batch_queue_fraction: float, stall_after_s: float,
                 report_max_age_s: float, prefill: Any = None, min_handoff_prompt_tokens: int = 0) -> None:
        super().__init__(executor, executor.geometry, tenants, max_queued_requests=max_queued_requests,
                         batch_queue_fraction=batch_queue_fraction, stall_after_s=stall_after_s)
        self._idle_snapshot = idle_snapshot(executor.geometry)
        self._generate = generate  # the replicas' handle, streaming, method `generate`
        self._prefill = prefill  # disaggregated: the prefill replicas' handle, streaming, method `prefill`
        self._min_handoff_prompt_tokens = min_handoff_prompt_tokens  # shorter prompts: whole on a decode replica
        self._board = board
        self._report_max_age_s = report_max_age_s
        self._runs: dict[RequestId, RemoteRun] = {}
        self.board_view = BoardView()
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._watch_task is None:
            self._watch_task = asyncio.create_task(self._watch_board(), name="fairlane-board-watch")

    def submit(self, request: Request) -> RequestStream:
        stream = self.track(request)
        run = RemoteRun(replica_call(request, self.geometry.block_size))
        self._runs[request.request_id] = run
        # In a context of its own, not the HTTP request's: Ray Serve cancels the handle calls a cancelled
        # request made (its "child requests"), behind the ingress's back. When a request ends is the
        # ingress's to say (`finish`): a background response outlives the request that started it.
        run.task = asyncio.create_task(self._run_remote(run), name=f"fairlane-remote-{request.request_id}",
                                       context=contextvars.Context())
        return stream

    async def _run_remote(self, run: RemoteRun) -> None:
        request = run.call.request
        try:
            if self._prefill is not None and may_hand_off(run.call, self._min_handoff_prompt_tokens):
                await self._run_disaggregated(run)
            else:
                await self._run_on(self._generate, run.call, run)
            if run.last is None or not run.last.is_final:
                self.deliver([ended(request, run.last, "error", "the replica ended the request without a result")])
        except asyncio.CancelledError:  # by `finish` or `shutdown`, which ended it; else it ends here
            self.deliver([ended(request, run.last, "abort")])
            raise
        except Exception as exc:  # the replica died or Ray Serve could not reach one
            logger.warning("request %s failed on its replica: %s", request.request_id, exc)
            self.deliver([ended(request, run.last, "error", f"the replica serving this request failed "
                                                            f"({type(exc).__name__}); retry it")])
        finally:
            self._runs.pop(request.request_id, None)

    async def _run_on(self, handle: Any, call: ReplicaCall, run: RemoteRun,
                      num_cached_tokens: int | None = None) -> None:
        """Deliver a replica call's events (their cached-token count replaced when given); cancelling the
        run cancels the call, which aborts the request on its replica."""
        responses = handle.remote(call)
        try:
            async for item in responses:
                if isinstance(item, HandoffNote):  # a decode replica received the prompt's blocks
                    run.call.request.kv_handoff_s = (run.publish_seconds or 0.0, item.seconds)  # for its trace
                    continue
                events = as_the_requests(item, run.call.request.request_id, num_cached_tokens)
                run.output_token_ids += [token for event in events for token in event.new_token_ids]
                run.last = events[-1]
                self.deliver(events)
        except BaseException:  # cancelled, or the call failed: abort it on its replica if that still runs
            responses.cancel()
            raise

    async def _run_disaggregated(self, run: RemoteRun) -> None:
        """The prompt and first token on a prefill replica, the rest on a decode replica that continues
        from the published blocks (cluster/handoff.py)."""
        request = run.call.request
        location, num_cached = None, None
        responses = self._prefill.remote(ReplicaCall(prefill_request(request), run.call.block_hashes))
        try:
            async for item in responses:
                if isinstance(item, HandoffNote):
                    location, run.publish_seconds = item.location, item.seconds
                    continue
                last = item[-1]
                if last.finish_reason == "error" and not run.output_token_ids:  # refused there (full, stopping)
                    logger.warning("request %s: its prefill replica gave no token (%s); a decode replica takes "
                                   "it whole", request.request_id, last.error)
                    break
                if last.is_final and ends_at_prefill(request, last):
                    run.last = last
                    self.deliver(item)
                    return
                events = [going_on(e) if e.is_final else e for e in item]
                run.output_token_ids += [token for event in events for token in event.new_token_ids]
                run.last, num_cached = events[-1], last.num_cached_tokens
                self.deliver(events)
        except asyncio.CancelledError:
            responses.cancel()
            raise
        except Exception as exc:  # its decode replica computes what the prefill replica did not give
            logger.warning("request %s lost its prefill replica (%s): a decode replica takes it whole",
                           request.request_id, exc)
        await self._decode(run, location, num_cached)

    async def _decode(self, run: RemoteRun, location: str | None, num_cached: int | None) -> None:
        """On a decode replica, from the tokens the request has; a decode replica lost mid-way hands it
        to another (Ray Serve's router picks a live one) with every token delivered so far."""
        request = run.call.request
        for attempt in range(DECODE_ATTEMPTS):
            continued = continuation(request, run.output_token_ids)
            if attempt:  # a name of its own: the replica that failed may be alive, its abort on the way
                continued = replace(continued, request_id=RequestId(f"{request.request_id}.{attempt}"))
            call = ReplicaCall(continued, run.call.block_hashes, location if attempt == 0 else None)
            try:
                await self._run_on(self._generate, call, run, num_cached)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if attempt + 1 == DECODE_ATTEMPTS or (run.last is not None and run.last.is_final):
                    raise
                logger.warning("request %s lost its decode replica (%s) after %d tokens: another continues it",
                               request.request_id, exc, len(run.output_token_ids))

    def finish(self, request_id: RequestId, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End a request here at once (its reader stopped: client gone or stop string) and cancel
        its replica call, which aborts it there."""
        run = self._runs.pop(request_id, None)
        if run is not None and run.task is not None:
            run.task.cancel()
        stream = self._streams.get(request_id)
        if stream is not None:  # its run may be gone already; a stream still tracked ends here all the same
            last = run.last if run is not None else None
            self.deliver([ended(stream.request, last, finish_reason(status) or "abort")])

    def health(self) -> EngineHealth:
        """Healthy while at least one replica reports healthy; the reasons of the others otherwise."""
        if self.failure is not None:
            return EngineHealth(False, f"the engine failed: {self.failure}")
        reports = self.board_view.reports
        if not reports:
            return EngineHealth(False, "no replica has reported yet")
        if any(r.is_healthy for r in reports):
            return EngineHealth(True)
        return EngineHealth(False, "; ".join(f"replica {r.replica_id}: {r.reason}" for r in reports))

    def replica_snapshots(self) -> dict[str, ReplicaState]:
        """Each live replica's latest scheduler snapshot, role and hand-off counters, by replica id: the
        ingress's /metrics."""
        return {r.replica_id: ReplicaState(r.snapshot, str(r.stats.get("role", "colocated")),
                                           r.stats.get("handoff", {}))
                for r in self.board_view.reports if r.snapshot is not None}

    def stats(self) -> dict[str, Any]:
        """The replicas' /stats added up, each replica's own under `replicas`."""
        reports = self.board_view.reports
        summed: dict[str, Any] = {key: sum(int(r.stats.get(key, 0)) for r in reports) for key in SUMMED_STATS}
        queried = sum(int(r.stats.get("prefix_cache", {}).get("queried_tokens", 0)) for r in reports)
        hits = sum(int(r.stats.get("prefix_cache", {}).get("hit_tokens", 0)) for r in reports)
        summed["prefix_cache"] = {"queried_tokens": queried, "hit_tokens": hits}
        summed["in_flight"] = self.num_unfinished
        summed["replicas"] = {r.replica_id: {**r.stats, "healthy": r.is_healthy, "reason": r.reason}
                              for r in reports}
        return summed

    async def _watch_board(self) -> None:
        """Keep the replicas' reports fresh for /health and /stats."""
        while True:
            try:
                self.board_view = BoardView(await self._board.reports.remote(self._report_max_age_s),
                                            time.monotonic())
            except Exception:
                logger.warning("the ingress could not read the board", exc_info=True)
            await asyncio.sleep(min(0.5, self._report_max_age_s / 4))

    async def shutdown(self, message: str = "the server is shutting down") -> None:
        """End every request still running on a replica with an error (cancelling it there), then stop."""
        self.stop_accepting()
        for request_id, run in list(self._runs.items()):
            del self._runs[request_id]
            if run.task is not None:
                run.task.cancel()
            self.deliver([ended(run.call.request, run.last, "error", message)])
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None

    @property
    def snapshot(self) -> SchedulerSnapshot:
        return self._idle_snapshot
