"""Prometheus metrics on a registry of the app's own, so several apps can live in one process.

Each kind of number is kept where it costs least:
- latency histograms, fed by an engine observer as token events go out (the only cost on the
  engine's task: a few histogram observations and dict increments per event);
- token and rejection counts, plain counters exported at scrape time;
- engine state (queues, KV and swap use, VTC counters, prefix cache, preemptions, swap traffic),
  read from the scheduler only when Prometheus scrapes, so serving pays nothing for it.

Names carry the `fairlane:` prefix and, where vLLM has the same metric, vLLM's name after it.
Label values are bounded: a tenant label is a tenant of the registry or "unknown".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.request_log import log_finished
from scheduling.request import Request, TokenEvent
from scheduling.scheduler import CLASSES
from scheduling.snapshot import SchedulerSnapshot
from tenancy.tenants import TenantRegistry

PREFIX = "fairlane:"
UNKNOWN_TENANT = "unknown"
CLASS_NAMES = tuple(c.value for c in CLASSES)

# Why the HTTP layer turned a request away; the label values of requests_rejected_total.
RejectionReason = Literal["unauthorized", "invalid_request", "rate_limit", "queue_full", "shutting_down"]
REJECTION_REASONS: tuple[RejectionReason, ...] = get_args(RejectionReason)

# vLLM's buckets, with finer ones at the low end for inter-token latency on an accelerator.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class TenantLabels:
    """Maps a tenant id to its label value: itself if the registry knows it, else "unknown"."""

    def __init__(self, tenants: TenantRegistry) -> None:
        self.known: tuple[str, ...] = tuple(sorted(t.tenant_id for t in tenants))
        self._known = frozenset(self.known)

    def __call__(self, tenant_id: str | None) -> str:
        return tenant_id if tenant_id in self._known else UNKNOWN_TENANT

    def present(self, *counts: Counter[str]) -> list[str]:
        """The registry's tenants, plus "unknown" once anything was counted under it."""
        return [*self.known, *([UNKNOWN_TENANT] if any(c[UNKNOWN_TENANT] for c in counts) else [])]


@dataclass(slots=True)
class RequestCounts:
    """Plain counters the observer and the HTTP layer increment; exported at scrape time."""

    prompt_tokens: Counter[str] = field(default_factory=Counter)  # by tenant label
    generation_tokens: Counter[str] = field(default_factory=Counter)  # by tenant label
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)  # by (reason, tenant label)


@dataclass(slots=True, frozen=True)
class _LatencySeries:
    """The histogram children of one (tenant, class), looked up once instead of per token."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram


class LatencyHistograms:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("tenant", "class")
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, registry=registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
                             labels, registry=registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                             labels, registry=registry, buckets=REQUEST_BUCKETS)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", labels, registry=registry,
                               buckets=REQUEST_BUCKETS)
        self._series: dict[tuple[str, str], _LatencySeries] = {}

    def series(self, tenant: str, class_name: str) -> _LatencySeries:
        key = (tenant, class_name)
        found = self._series.get(key)
        if found is None:
            found = _LatencySeries(self.ttft.labels(*key), self.itl.labels(*key), self.e2e.labels(*key),
                                   self.queue.labels(*key))
            self._series[key] = found
        return found


class RequestObserver:
    """An EngineObserver: latencies and token counts per tenant and class, and the request log line."""

    def __init__(self, histograms: LatencyHistograms, labels: TenantLabels, counts: RequestCounts) -> None:
        self._histograms = histograms
        self._labels = labels
        self._counts = counts
        self._last_token_time: dict[str, float] = {}  # requests that have had a token, until they finish

    def on_tokens(self, request: Request, event: TokenEvent, now: float) -> None:
        tenant = self._labels(request.tenant_id)
        series = self._histograms.series(tenant, request.priority.value)
        self._counts.generation_tokens[tenant] += len(event.new_token_ids)
        last = self._last_token_time.get(request.request_id)
        if last is None:  # the prefill is done: the prompt counts once, as in vLLM
            series.ttft.observe(now - request.arrival_time)
            self._counts.prompt_tokens[tenant] += request.num_prompt_tokens
        else:
            series.itl.observe(now - last)
        self._last_token_time[request.request_id] = now

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None:
        self._last_token_time.pop(request.request_id, None)
        series = self._histograms.series(self._labels(request.tenant_id), request.priority.value)
        series.e2e.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            series.queue.observe(request.first_scheduled_time - request.arrival_time)
        log_finished(request, event, now)


# ---- engine state, read at scrape time (and by the dashboard) ----------------------------------


def requests_by_class(snapshot: SchedulerSnapshot) -> dict[str, dict[str, int]]:
    """Running, waiting and swapped requests of each class."""
    return {name: {"running": load.running, "waiting": load.waiting, "swapped": load.swapped}
            for name, load in snapshot.by_class.items()}


def vtc_counters(snapshot: SchedulerSnapshot, labels: TenantLabels) -> dict[str, dict[str, float]]:
    """Each known tenant's virtual token counter per class (0 before its first charge)."""
    return {name: {tenant: counters.get(tenant, 0.0) for tenant in labels.known}
            for name, counters in snapshot.vtc.items()}


def queued_by_tenant(snapshot: SchedulerSnapshot, labels: TenantLabels) -> dict[str, dict[str, int]]:
    """Waiting requests per class and tenant label."""
    queued = {name: dict.fromkeys(labels.known, 0) for name in CLASS_NAMES}
    for name, by_tenant in snapshot.queued_by_tenant.items():
        for tenant_id, count in by_tenant.items():
            tenant = labels(tenant_id)
            queued[name][tenant] = queued[name].get(tenant, 0) + count
    return queued


class EngineCollector(Collector):
    """Gauges and counters computed from the scheduler's snapshot and the plain counters when scraped."""

    def __init__(self, snapshot: Callable[[], SchedulerSnapshot], labels: TenantLabels, counts: RequestCounts
                 ) -> None:
        self._snapshot = snapshot
        self._labels = labels
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._memory()
        yield from self._scheduler_counters()
        yield from self._request_counters()

    def _requests(self) -> Iterator[Metric]:
        by_class = requests_by_class(self._snapshot())
        for state, what in (("running", "running"), ("waiting", "waiting to be scheduled"),
                            ("swapped", "preempted, their KV in the CPU swap pool")):
            gauge = GaugeMetricFamily(PREFIX + f"num_requests_{state}", f"Requests {what}.", labels=["class"])
            for class_name, counts in by_class.items():
                gauge.add_metric([class_name], counts[state])
            yield gauge
        vtc = GaugeMetricFamily(PREFIX + "tenant_vtc_counter", "Virtual token counter of each tenant and class.",
                                labels=["tenant", "class"])
        for class_name, counters in vtc_counters(self._snapshot(), self._labels).items():
            for tenant, value in counters.items():
                vtc.add_metric([tenant, class_name], value)
        yield vtc

    def _memory(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Share of device KV blocks in use, 0 to 1.",
                                value=snapshot.kv_blocks.fraction)
        yield GaugeMetricFamily(PREFIX + "cpu_swap_usage_perc", "Share of CPU swap-pool blocks in use, 0 to 1.",
                                value=snapshot.cpu_blocks.fraction)

    def _scheduler_counters(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=snapshot.prefix_queried_tokens)
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=snapshot.prefix_hit_tokens)
        preemptions = CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted, by mode.",
                                          labels=["mode"])
        for mode, count in snapshot.preemptions.items():
            preemptions.add_metric([mode], count)
        yield preemptions
        swap = CounterMetricFamily(PREFIX + "swap_bytes", "KV bytes copied between device and CPU pools.",
                                   labels=["direction"])
        swap.add_metric(["out"], snapshot.blocks_swapped_out * snapshot.bytes_per_block)
        swap.add_metric(["in"], snapshot.blocks_swapped_in * snapshot.bytes_per_block)
        yield swap

    def _request_counters(self) -> Iterator[Metric]:
        counts = self._counts
        for name, counter, what in (("prompt_tokens", counts.prompt_tokens, "Prompt tokens prefilled."),
                                    ("generation_tokens", counts.generation_tokens, "Tokens generated.")):
            family = CounterMetricFamily(PREFIX + name, what, labels=["tenant"])
            for tenant in self._labels.present(counter):
                family.add_metric([tenant], counter[tenant])
            yield family
        rejected = CounterMetricFamily(PREFIX + "requests_rejected", "Requests turned away, by reason and tenant.",
                                       labels=["reason", "tenant"])
        for (reason, tenant), value in sorted(counts.rejected.items()):
            rejected.add_metric([reason, tenant], value)
        yield rejected


class ServingMetrics:
    """The metrics of one app: its registry, the engine observer, and the rejection counter."""

    def __init__(self, snapshot: Callable[[], SchedulerSnapshot], tenants: TenantRegistry) -> None:
        self.registry = CollectorRegistry()
        self.labels = TenantLabels(tenants)
        self.counts = RequestCounts()
        self.observer = RequestObserver(LatencyHistograms(self.registry), self.labels, self.counts)
        self.registry.register(EngineCollector(snapshot, self.labels, self.counts))

    def record_rejection(self, reason: RejectionReason, tenant_id: str | None = None) -> None:
        """Count a request the HTTP layer turned away; tenant_id None when the caller is not known."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {REJECTION_REASONS}")
        self.counts.rejected[(reason, self.labels(tenant_id))] += 1

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


def rejection_reason(status: int, code: str | None = None) -> RejectionReason | None:
    """The rejection reason of an error answer, None for one that is not a rejection (a 5xx fault)."""
    if status in (401, 403):
        return "unauthorized"
    if status == 429:
        return "rate_limit"
    if status == 503:
        return "shutting_down" if code == "server_shutting_down" else "queue_full"
    if 400 <= status < 500:
        return "invalid_request"
    return None

