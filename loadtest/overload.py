"""`python -m loadtest overload`: ten times the clients the server can serve, each well-behaved.

Three phases:
1. capacity: `capacity_clients` closed-loop users of interactive streamed chats; their completed
   tokens per second are what the server can serve, their TTFT the reference;
2. surge: `factor` times as many users, part of them sending batch-class (flex) chats; a refused
   request (429, 503) is retried after its Retry-After, or after an exponential backoff with jitter
   when it has none, so the load is what real clients that honour the server would send;
3. recovery: the surge's users stop starting requests; one interactive probe at a time measures how
   long until a probe's TTFT is back within `recovered_ttft_factor` of the capacity phase's median.

The server refuses only once its queue fills (`max_queued_requests`, batch-class requests at
`batch_queue_fraction` of it), so a run meant to see refusals starts the server with a queue smaller
than the surge: `fairlane serve --max-queued-requests 32` for the default 80 clients, 40 of them
batch-class, leaves batch 24 places and interactive the other 8, as many as the capacity phase's clients.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.client import OK, UNFINISHED, RequestRecord, send_chat, served_model
from loadtest.stats import percentile
from loadtest.workload import ANONYMOUS, BATCH, INTERACTIVE, ChatRequest, LoadTenant, batch_request, chat_request

REFUSED = frozenset({"429", "503"})
CAPACITY = "capacity"
SURGE = "surge"
RECOVERY = "recovery"
MAX_SECONDS = 3600.0
FIRST_BACKOFF_S = 0.5
PROBE_INTERVAL_S = 0.5


@dataclass(slots=True, frozen=True)
class OverloadConfig:
    url: str
    capacity_clients: int = 8  # what the server serves at once (its max_num_seqs, say)
    factor: int = 10  # the surge brings this many times capacity_clients
    capacity_s: float = 30.0
    surge_s: float = 120.0
    batch_share: float = 0.5  # of the surge's users, those that send batch-class work
    max_backoff_s: float = 30.0
    recovery_timeout_s: float = 120.0
    recovered_ttft_factor: float = 2.0
    seed: int = 0
    tenants: tuple[LoadTenant, ...] = (ANONYMOUS,)
    request_timeout_s: float = 300.0

    def check(self) -> None:
        if self.capacity_clients < 1 or self.factor < 1 or not 0 <= self.batch_share < 1:
            raise ValueError("capacity clients and factor must be positive, batch share in [0, 1)")
        if not all(0 < s <= MAX_SECONDS for s in (self.capacity_s, self.surge_s, self.recovery_timeout_s)):
            raise ValueError(f"phase durations must be in (0, {MAX_SECONDS:g}] seconds")


@dataclass(slots=True)
class Attempt:
    """One request as the server answered it; a retried request makes one attempt per try."""

    phase: str
    record: RequestRecord
    is_retry: bool = False  # a try after a refusal; the request's first try is not


@dataclass(slots=True)
class OverloadResult:
    config: OverloadConfig
    model: str
    attempts: list[Attempt]
    phase_spans: dict[str, tuple[float, float]]  # phase -> (start, end) seconds since the start
    recovery_s: float | None  # None: not recovered within the timeout
    probes: list[RequestRecord] = field(default_factory=list)


class Surge:
    def __init__(self, config: OverloadConfig, http: httpx.AsyncClient, model: str) -> None:
        self.config = config
        self.http = http
        self.model = model
        self.attempts: list[Attempt] = []
        self.phase = CAPACITY
        self.is_sending = True
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    async def send(self, request: ChatRequest, *, is_retry: bool = False) -> RequestRecord:
        record = RequestRecord(request.tenant.tenant_id, request.klass, self.now())
        self.attempts.append(Attempt(self.phase, record, is_retry))
        await send_chat(self.http, self.model, request, record, self.now)
        return record

    async def send_until_served(self, request: ChatRequest, rng: random.Random) -> None:
        """Retry a refused request as a well-behaved client does, while the phase lasts."""
        backoff_s = FIRST_BACKOFF_S
        is_retry = False
        while self.is_sending:
            record = await self.send(request, is_retry=is_retry)
            if record.outcome not in REFUSED:
                return
            is_retry = True
            await asyncio.sleep(retry_delay(record.retry_after, backoff_s, rng))
            backoff_s = min(backoff_s * 2, self.config.max_backoff_s)

    async def user(self, tenant: LoadTenant, klass: str, rng: random.Random) -> None:
        make: Callable[[LoadTenant, random.Random], ChatRequest] = (
            chat_request if klass == INTERACTIVE else batch_request)
        while self.is_sending:
            await self.send_until_served(make(tenant, rng), rng)


def retry_delay(retry_after: str | None, backoff_s: float, rng: random.Random) -> float:
    """Retry-After when the server gave one (in seconds), else the backoff; jittered either way so
    refused clients do not come back in step."""
    try:
        base = float(retry_after) if retry_after is not None else backoff_s
    except ValueError:  # an HTTP date: this tool's servers send seconds; back off instead
        base = backoff_s
    return max(base, backoff_s) * rng.uniform(1.0, 1.5)


def start_users(surge: Surge, classes: list[str]) -> list[asyncio.Task[None]]:
    """One user per class given, started in that order; each class's users take the tenants in turn."""
    tenants = surge.config.tenants
    surge.is_sending = True
    num_in_class: Counter[str] = Counter()
    users = []
    for i, klass in enumerate(classes):
        tenant = tenants[num_in_class[klass] % len(tenants)]
        num_in_class[klass] += 1
        rng = random.Random(f"{surge.config.seed}/{surge.phase}/{i}")
        users.append(asyncio.create_task(surge.user(tenant, klass, rng)))
    return users


async def stop_users(surge: Surge, users: list[asyncio.Task[None]], drain_s: float) -> None:
    """No new requests; what runs gets drain_s to end, then is cancelled (the client leaves)."""
    surge.is_sending = False
    _, pending = await asyncio.wait(users, timeout=drain_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*users, return_exceptions=True)


def surge_classes(config: OverloadConfig) -> list[str]:
    """The surge's users' classes, batch ones spread evenly through the list: users start in this
    order, and the first to arrive take the empty queue's places, so neither class is given a head start."""
    count = config.capacity_clients * config.factor
    num_batch = round(count * config.batch_share)
    return [BATCH if (i + 1) * num_batch // count > i * num_batch // count else INTERACTIVE for i in range(count)]


async def measure_recovery(surge: Surge, reference_ttft_s: float, timeout_s: float
                           ) -> tuple[float | None, list[RequestRecord]]:
    """Seconds from now until an interactive probe's TTFT is within the factor of the reference."""
    start = surge.now()
    rng = random.Random(f"{surge.config.seed}/probe")
    probes = []
    while surge.now() - start < timeout_s:
        record = await surge.send(chat_request(surge.config.tenants[0], rng))
        probes.append(record)
        if record.outcome == OK and record.ttft_s is not None and \
                record.ttft_s <= reference_ttft_s * surge.config.recovered_ttft_factor:
            return record.sent_at - start, probes
        await asyncio.sleep(PROBE_INTERVAL_S)
    return None, probes


async def run_overload(config: OverloadConfig) -> OverloadResult:
    config.check()
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits) as http:
        surge = Surge(config, http, await served_model(http, config.tenants[0]))
        users = start_users(surge, [INTERACTIVE] * config.capacity_clients)
        await asyncio.sleep(config.capacity_s)
        await stop_users(surge, users, config.request_timeout_s)
        spans = {CAPACITY: (0.0, surge.now())}
        surge.phase = SURGE
        users = start_users(surge, surge_classes(config))
        await asyncio.sleep(config.surge_s)
        spans[SURGE] = (spans[CAPACITY][1], surge.now())
        # What the surge's users started still runs while the probes measure the recovery.
        surge.phase = RECOVERY
        reference = percentile(capacity_ttfts(surge.attempts), 50) or 1.0
        (recovery_s, probes), _ = await asyncio.gather(
            measure_recovery(surge, reference, config.recovery_timeout_s),
            stop_users(surge, users, config.request_timeout_s))
        spans[RECOVERY] = (spans[SURGE][1], surge.now())
    return OverloadResult(config, surge.model, surge.attempts, spans, recovery_s, probes)


def capacity_ttfts(attempts: list[Attempt]) -> list[float]:
    return [a.record.ttft_s for a in attempts if a.phase == CAPACITY and a.record.ttft_s is not None]


def summary_of(attempts: list[Attempt], phase: str, span: tuple[float, float]) -> dict[str, Any]:
    """What one phase's attempts got, overall and per class."""
    chosen = [a for a in attempts if a.phase == phase]
    seconds = max(span[1] - span[0], 1e-9)
    return {"seconds": round(seconds, 2), "span": [round(span[0], 2), round(span[1], 2)], **_group(chosen, seconds),
            "by_class": {klass: _group([a for a in chosen if a.record.klass == klass], seconds)
                         for klass in sorted({a.record.klass for a in chosen})}}


def _group(attempts: list[Attempt], seconds: float) -> dict[str, Any]:
    records = [a.record for a in attempts]
    served = [r for r in records if r.outcome == OK]
    ttft = [r.ttft_s for r in served if r.ttft_s is not None]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "attempts": len(records), "ok": len(served), "outcomes": dict(sorted(outcomes.items())),
        **_refusals(attempts),
        "goodput_tokens_per_s": sum(r.completion_tokens for r in served) / seconds,
        "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
    }


def _refusals(attempts: list[Attempt]) -> dict[str, Any]:
    """Refusals per attempt, and per request: a request is retried only after a refusal, so it was
    refused at least once exactly when its first try was (a first try still running at the end was
    let in). Per request, a class whose admitted clients sit in long requests (and so try less often)
    does not look refused more often than it is, as it can per attempt."""
    refused = [a.record for a in attempts if a.record.outcome in REFUSED]
    first_tries = [a.record for a in attempts if not a.is_retry]
    first_refused = sum(r.outcome in REFUSED for r in first_tries)
    return {
        "refused": len(refused),
        "refused_share": _share(len(refused), sum(a.record.outcome != UNFINISHED for a in attempts)),
        "refused_without_retry_after": sum(r.retry_after is None for r in refused),
        "requests": len(first_tries), "requests_refused": first_refused,
        "requests_refused_share": _share(first_refused, len(first_tries)),
    }


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
