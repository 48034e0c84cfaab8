"""`python -m loadtest soak`: hours of mixed traffic, and whether the server comes back to where it
was once the traffic stops.

The run has four phases, each sampled every `sample_s` from outside (loadtest.probe):
1. warm-up: traffic until the server has compiled, cached and allocated what it keeps for good;
2. baseline: traffic stops, the server settles to idle, a few idle samples are the baseline;
3. load: traffic for the rest of the run;
4. idle: traffic stops, the server settles, and idle samples are compared with the baseline.

A resource leaks when its idle value after the load is above its baseline by more than a margin;
KV or swap blocks held once idle, or requests that never end, fail the run at once (loadtest.client's
leak check). Latency drift is the last load window's percentiles against the first's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.client import SettleResult, read_stats, served_model, settle
from loadtest.probe import Sample, ServerProbe
from loadtest.soak_traffic import MIX, Traffic, user
from loadtest.workload import ANONYMOUS, LoadTenant

MAX_MINUTES = 24 * 60
WARMUP = "warmup"
BASELINE = "baseline"
LOAD = "load"
IDLE = "idle"
NUM_IDLE_SAMPLES = 3  # the baseline and the end are each the median of this many idle samples


@dataclass(slots=True, frozen=True)
class SoakConfig:
    url: str
    minutes: float
    clients: int = 8  # closed-loop users, spread over the tenants
    think_s: float = 0.5  # mean pause between a user's requests
    warmup_s: float = 60.0  # of the run's minutes, before the baseline
    sample_s: float = 5.0
    window_s: float = 60.0  # latency percentiles per window of this many seconds
    seed: int = 0
    tenants: tuple[LoadTenant, ...] = (ANONYMOUS,)
    admin_key: str | None = None
    pid: int | None = None  # the server's process; by default the pid its /stats gives
    request_timeout_s: float = 120.0
    drain_timeout_s: float = 120.0  # for the requests still running when the traffic stops
    settle_timeout_s: float = 60.0
    rss_margin_bytes: int = 64 * 1024 * 1024  # idle RSS after the load may exceed the baseline by this
    fd_margin: int = 4  # open files (keep-alive sockets a client has not closed yet, a log rotation)
    task_margin: int = 2  # asyncio tasks (a connection's task ending late)

    def check(self) -> None:
        if not 0 < self.minutes <= MAX_MINUTES:
            raise ValueError(f"minutes must be in (0, {MAX_MINUTES}]")
        if self.warmup_s >= self.minutes * 60:
            raise ValueError("the warm-up must be shorter than the run")
        if self.clients < 1 or self.sample_s <= 0 or self.window_s <= 0 or self.think_s < 0:
            raise ValueError("clients, sample and window seconds must be positive")


@dataclass(slots=True)
class SoakResult:
    config: SoakConfig
    model: str
    traffic: Traffic
    samples: list[Sample]
    load_started_at: float  # seconds since the start, when phase 3 began
    load_ended_at: float  # when its users stopped starting requests (what they had started then ran on)
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    settles: list[SettleResult] = field(default_factory=list)  # after the warm-up, after the load


class Sampler:
    """Samples in the background, tagged with the current phase."""

    def __init__(self, probe: ServerProbe, interval_s: float) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.phase = WARMUP
        self.samples: list[Sample] = []
        self.errors = 0  # samples that could not be taken (the server busy past the timeout, say)

    async def take(self) -> Sample | None:
        try:
            sample = await self.probe.sample(self.phase)
        except httpx.HTTPError:
            self.errors += 1
            return None
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while True:
            await self.take()
            await asyncio.sleep(self.interval_s)


async def run_traffic(traffic: Traffic, config: SoakConfig, seconds: float, round_name: str) -> None:
    """The users send for `seconds`, then finish what they started (bounded by the drain timeout)."""
    traffic.is_sending = True
    kinds = list(MIX)  # shared out: user i starts with kinds i, i + clients, ...
    users = [asyncio.create_task(user(traffic, config.tenants[i % len(config.tenants)],
                                      random.Random(f"{config.seed}/{round_name}/{i}"), config.think_s,
                                      kinds[i::config.clients]))
             for i in range(config.clients)]
    await asyncio.sleep(seconds)
    traffic.is_sending = False
    _, pending = await asyncio.wait(users, timeout=config.drain_timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*users, return_exceptions=True)


async def idle_samples(sampler: Sampler, http: httpx.AsyncClient, config: SoakConfig) -> SettleResult:
    """Settle to idle, then a few idle samples in the current phase."""
    settled = await settle(http, config.settle_timeout_s, admin_key=config.admin_key)
    for _ in range(NUM_IDLE_SAMPLES):
        await asyncio.sleep(config.sample_s)
        await sampler.take()
    return settled


async def run_soak(config: SoakConfig) -> SoakResult:
    config.check()
    start = time.perf_counter()
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=config.url, timeout=30.0) as probe_http:
        model = await served_model(probe_http, config.tenants[0])
        stats_before = await read_stats(probe_http, config.admin_key)
        sampler = Sampler(ServerProbe(probe_http, config.admin_key, config.pid, start), config.sample_s)
        sampling = asyncio.create_task(sampler.run())
        settles = []
        # The traffic has its own client, closed before each idle phase: its sockets must not count as the server's.
        async with httpx.AsyncClient(base_url=config.url, timeout=timeout) as http:
            traffic = Traffic(http, model, start)
            await run_traffic(traffic, config, config.warmup_s, WARMUP)
        sampler.phase = BASELINE
        settles.append(await idle_samples(sampler, probe_http, config))
        sampler.phase = LOAD
        load_started_at = time.perf_counter() - start
        load_s = config.minutes * 60 - config.warmup_s
        async with httpx.AsyncClient(base_url=config.url, timeout=timeout) as http:
            traffic.http = http
            await run_traffic(traffic, config, load_s, LOAD)
        sampler.phase = IDLE
        settles.append(await idle_samples(sampler, probe_http, config))
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        stats_after = await read_stats(probe_http, config.admin_key)
    return SoakResult(config, model, traffic, sampler.samples, load_started_at, load_started_at + load_s, stats_before,
                      stats_after, settles)
