"""The load-test scenarios: who sends what, when, to one server, bounded in count and time.

Every scenario is a set of sources sharing one `LoadRun`: Poisson sources (open loop: arrivals do
not wait for answers, like independent users) and closed-loop sources (a backlog: the next request
leaves when the previous one ends). Sources stop at `duration_s` or when `max_requests` have been
sent; requests still running then get `drain_timeout_s` to end before they are cancelled.
Arrival times and request shapes come from per-tenant seeded generators, so a seed replays the
same traffic.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from loadtest.batch_job import run_batch_job
from loadtest.client import RequestRecord, SettleResult, read_stats, send_chat, served_model, settle
from loadtest.workload import (
    ANONYMOUS,
    BATCH_API,
    ChatRequest,
    LoadTenant,
    batch_request,
    chat_request,
    disconnect_request,
    shared_prefix_request,
    shared_system_prompt,
)

# Hard caps: a run cannot be asked for more than this, whatever the flags say.
MAX_DURATION_S = 600.0
MAX_REQUESTS = 10_000
MAX_WAIT_S = 600.0
SKEW_FACTOR = 10  # the skew scenario's first tenant sends this many times what each other one sends

MakeRequest = Callable[[random.Random], ChatRequest]
Source = Coroutine[Any, Any, None]


@dataclass(slots=True, frozen=True)
class RunConfig:
    scenario: str
    url: str
    duration_s: float = 20.0  # sources send for this long
    rate: float = 2.0  # interactive arrivals per second, all tenants together
    max_requests: int = 500  # requests sent at most (batch-api items count)
    seed: int = 0
    tenants: tuple[LoadTenant, ...] = (ANONYMOUS,)
    backlog: int = 8  # flood: batch-class requests kept in flight, spread over the tenants
    batch_items: int = 16  # batch-api: items in all, spread over the tenants (one batch each)
    request_timeout_s: float = 120.0  # per request, between bytes
    drain_timeout_s: float = 60.0  # after duration_s, for the requests still running
    settle_timeout_s: float = 30.0  # for the server to come back to idle before the leak check fails
    admin_key: str | None = None  # the tenants file's [admin] api_key: reads /stats on a server with tenants

    def check(self) -> None:
        """Raise ValueError for a run that the caps or the scenario do not allow."""
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; choose from {', '.join(SCENARIOS)}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration must be in (0, {MAX_DURATION_S:g}] seconds")
        if not 1 <= self.max_requests <= MAX_REQUESTS:
            raise ValueError(f"max requests must be in [1, {MAX_REQUESTS}]")
        if self.rate <= 0 or self.backlog < 1 or self.batch_items < 1:
            raise ValueError("rate, backlog and batch items must be positive")
        waits = (self.request_timeout_s, self.drain_timeout_s, self.settle_timeout_s)
        if not all(0 < wait <= MAX_WAIT_S for wait in waits):
            raise ValueError(f"timeouts must be in (0, {MAX_WAIT_S:g}] seconds")
        if self.scenario == "skew" and len(self.tenants) < 2:
            raise ValueError("the skew scenario needs a tenants file with at least two tenants")

    def rng(self, tenant: LoadTenant, role: str) -> random.Random:
        return random.Random(f"{self.seed}/{self.scenario}/{tenant.tenant_id}/{role}")


@dataclass(slots=True)
class RunResult:
    config: RunConfig
    model: str
    records: list[RequestRecord]
    wall_s: float  # from the first request to the end of the last response
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    settle: SettleResult
    batches: list[dict[str, Any]] = field(default_factory=list)  # batch-api: one summary per batch job


class LoadRun:
    """What one run's sources share: the clock, the request budget and the requests in flight."""

    def __init__(self, config: RunConfig, http: httpx.AsyncClient, model: str) -> None:
        self.config = config
        self.http = http
        self.model = model
        self.records: list[RequestRecord] = []
        self.batches: list[dict[str, Any]] = []
        self._num_left = config.max_requests
        self._in_flight: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    @property
    def is_open(self) -> bool:
        return self.now() < self.config.duration_s and self._num_left > 0

    def take(self, count: int) -> int:
        """Take up to count requests from the budget; returns how many were granted."""
        granted = min(count, self._num_left) if self.is_open else 0
        self._num_left -= granted
        return granted

    def new_record(self, tenant: LoadTenant, klass: str) -> RequestRecord:
        record = RequestRecord(tenant.tenant_id, klass, self.now())
        self.records.append(record)
        return record

    def track(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.append(task)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    def launch(self, request: ChatRequest) -> asyncio.Task[None] | None:
        """Send one chat request in the background, if the run is still open and the budget allows."""
        if not self.take(1):
            return None
        record = self.new_record(request.tenant, request.klass)
        return self.track(send_chat(self.http, self.model, request, record, self.now))

    async def drain(self) -> None:
        """Wait for what is in flight, up to the drain timeout; cancel the rest (they stay unfinished)."""
        pending = set(self._in_flight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.config.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in self._tasks:  # what the server or network does is an outcome; anything else is a bug
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError("a load-test request failed unexpectedly") from task.exception()


async def poisson_source(run: LoadRun, rate: float, make: MakeRequest, rng: random.Random) -> None:
    """Open-loop arrivals at `rate` per second until the run closes."""
    arrival = 0.0
    while True:
        arrival += rng.expovariate(rate)
        if arrival >= run.config.duration_s:
            return
        await asyncio.sleep(max(0.0, arrival - run.now()))
        if run.launch(make(rng)) is None:
            return


async def backlog_source(run: LoadRun, make: MakeRequest, rng: random.Random) -> None:
    """One request always in flight until the run closes: a client working through a backlog."""
    while (task := run.launch(make(rng))) is not None:
        await asyncio.wait({task}, timeout=max(0.0, run.config.duration_s - run.now()))
        if not task.done():
            return  # the run closed under it; drain() owns the request from here


def split_rate(config: RunConfig, parts: list[float] | None = None) -> list[tuple[LoadTenant, float]]:
    """The interactive rate shared by the tenants, evenly unless parts say otherwise."""
    shares = parts or [1.0] * len(config.tenants)
    return [(tenant, config.rate * share / sum(shares)) for tenant, share in zip(config.tenants, shares, strict=True)]


def interactive_sources(run: LoadRun, make: Callable[[LoadTenant], MakeRequest],
                        parts: list[float] | None = None) -> list[Source]:
    return [poisson_source(run, rate, make(tenant), run.config.rng(tenant, "interactive"))
            for tenant, rate in split_rate(run.config, parts)]


def chat_scenario(run: LoadRun) -> list[Source]:
    return interactive_sources(run, lambda tenant: partial(chat_request, tenant))


def flood_scenario(run: LoadRun) -> list[Source]:
    tenants = run.config.tenants
    backlog = [backlog_source(run, partial(batch_request, tenants[i % len(tenants)]),
                              run.config.rng(tenants[i % len(tenants)], f"backlog-{i}"))
               for i in range(run.config.backlog)]
    return [*backlog, *chat_scenario(run)]


def skew_scenario(run: LoadRun) -> list[Source]:
    parts = [float(SKEW_FACTOR)] + [1.0] * (len(run.config.tenants) - 1)
    return interactive_sources(run, lambda tenant: partial(chat_request, tenant), parts)


def shared_prefix_scenario(run: LoadRun) -> list[Source]:
    system_prompt = shared_system_prompt(run.config.seed)
    return interactive_sources(run, lambda tenant: partial(shared_prefix_request, tenant,
                                                           system_prompt=system_prompt))


def disconnect_scenario(run: LoadRun) -> list[Source]:
    return interactive_sources(run, lambda tenant: partial(disconnect_request, tenant))


def batch_api_scenario(run: LoadRun) -> list[Source]:
    """One Batch API job per tenant, with interactive probes at the rate while they run."""
    tenants = run.config.tenants
    for index, tenant in enumerate(tenants):
        share = run.config.batch_items // len(tenants) + (index < run.config.batch_items % len(tenants))
        rng = run.config.rng(tenant, "batch-api")
        items = [batch_request(tenant, rng, BATCH_API) for _ in range(run.take(share))]
        if items:
            records = [run.new_record(tenant, BATCH_API) for _ in items]
            run.track(run_batch_job(run.http, run.model, items, records, run.now, run.batches))
    return chat_scenario(run)


SCENARIOS: dict[str, Callable[[LoadRun], list[Source]]] = {
    "chat": chat_scenario,
    "flood": flood_scenario,
    "skew": skew_scenario,
    "shared-prefix": shared_prefix_scenario,
    "disconnect": disconnect_scenario,
    "batch-api": batch_api_scenario,
}


async def run_scenario(config: RunConfig) -> RunResult:
    """Run one scenario against config.url, then the leak check. Raises ValueError for a bad config
    and httpx errors when the server cannot be reached at the start."""
    config.check()
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits) as http:
        model = await served_model(http, config.tenants[0])
        stats_before = await read_stats(http, config.admin_key)
        run = LoadRun(config, http, model)
        await asyncio.gather(*SCENARIOS[config.scenario](run))
        await run.drain()
        wall_s = max((record.ended_at for record in run.records), default=run.now())
        settled = await settle(http, config.settle_timeout_s, admin_key=config.admin_key)
    return RunResult(config, model, run.records, wall_s, stats_before, settled.stats, settled, run.batches)
