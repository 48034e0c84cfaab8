"""Prometheus metrics on a registry of the app's own, so several apps can live in one process.

Each kind of number is kept where it costs least:
- per-request histograms (latencies, phase times, token counts), fed by an engine observer as token
  events go out (the only cost on the engine's task: a few histogram observations and dict
  increments per event);
- token, finish and rejection counts, plain counters exported at scrape time;
- engine state (queues, KV and swap use, VTC counters, prefix cache, preemptions, swap traffic),
  read from the scheduler's snapshot only when Prometheus scrapes, so serving pays nothing for it.

Names carry the `fairlane:` prefix; with `metrics_names = "vllm"` every family is served again under
`vllm:`. Each metric that vLLM's published Grafana dashboard queries exists here with vLLM's name,
meaning and buckets (request-time histograms add finer buckets below vLLM's first), split by
tenant and class where vLLM has one series. Every series carries `model_name`, as in vLLM. Label
values are bounded: a tenant label is a tenant of the registry or "unknown". On a cluster's ingress
the engine state is each replica's, from its latest report, with a `replica` label.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.observability.metric_names import (
    ITL_BUCKETS,
    PREFIX,
    REQUEST_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    MetricsOptions,
    WithAliases,
    token_count_buckets,
)
from app.observability.request_log import log_finished
from scheduling.request import Request, TokenEvent
from scheduling.scheduler import CLASSES
from scheduling.snapshot import SchedulerSnapshot
from tenancy.tenants import TenantRegistry

UNKNOWN_TENANT = "unknown"
CLASS_NAMES = tuple(c.value for c in CLASSES)
FINISH_REASONS = ("stop", "length", "abort", "error")  # the finished_reason values of request_success_total
# The Batch API's statuses, as OpenAI names them: the status label values of batch_jobs.
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")

# Why the HTTP layer turned a request away; the label values of requests_rejected_total.
RejectionReason = Literal["unauthorized", "invalid_request", "rate_limit", "queue_full", "shutting_down"]
REJECTION_REASONS: tuple[RejectionReason, ...] = get_args(RejectionReason)


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
    finished: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # by (reason, tenant label, class)
    ttft_deadlines: Counter[tuple[str, str]] = field(default_factory=Counter)  # by ("met" or "missed", tenant label)
    # Batches by (tenant label, status) as the store last said; None on an app without a Batch API.
    batch_jobs: Counter[tuple[str, str]] | None = None


@dataclass(slots=True, frozen=True)
class _RequestSeries:
    """The histogram children of one (tenant, class), looked up once instead of per token."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    inference: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    max_generation_tokens: Histogram


# Each histogram of a request: (its _RequestSeries field, name, help, buckets; None for token counts).
_HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...] | None], ...] = (
    ("ttft", "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Time between two tokens of a request.", ITL_BUCKETS),
    # vLLM's time_per_output_token_seconds: one observation per token after the first, as for itl.
    ("tpot", "time_per_output_token_seconds", "Time between two tokens of a request, on vLLM's buckets.",
     TPOT_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "Time from arrival to the end of a request.", REQUEST_BUCKETS),
    ("queue", "request_queue_time_seconds", "Time from arrival to first being scheduled.", REQUEST_BUCKETS),
    ("prefill", "request_prefill_time_seconds", "Time from first being scheduled to the first token.",
     REQUEST_BUCKETS),
    ("decode", "request_decode_time_seconds", "Time from the first token to the last.", REQUEST_BUCKETS),
    ("inference", "request_inference_time_seconds", "Time from first being scheduled to the last token.",
     REQUEST_BUCKETS),
    ("prompt_tokens", "request_prompt_tokens", "Prompt tokens of each finished request.", None),
    ("generation_tokens", "request_generation_tokens", "Tokens generated by each finished request.", None),
    ("max_generation_tokens", "request_max_num_generation_tokens",
     "Most tokens generated by one sequence of a finished request (a request is one sequence here).", None),
)


class RequestHistograms:
    """Every per-request histogram, by (model_name, tenant, class)."""

    def __init__(self, registry: CollectorRegistry, options: MetricsOptions) -> None:
        self._model_name = options.model_name
        token_buckets = token_count_buckets(options.max_model_len)
        self._families = {field_name: Histogram(PREFIX + name, what, ("model_name", "tenant", "class"),
                                                registry=registry, buckets=buckets or token_buckets)
                          for field_name, name, what, buckets in _HISTOGRAMS}
        self._series: dict[tuple[str, str], _RequestSeries] = {}

    def series(self, tenant: str, class_name: str) -> _RequestSeries:
        key = (tenant, class_name)
        found = self._series.get(key)
        if found is None:
            found = _RequestSeries(**{field_name: family.labels(self._model_name, tenant, class_name)
                                      for field_name, family in self._families.items()})
            self._series[key] = found
        return found


class RequestObserver:
    """An EngineObserver: latencies and token counts per tenant and class, and the request log line."""

    def __init__(self, histograms: RequestHistograms, labels: TenantLabels, counts: RequestCounts) -> None:
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
            if request.ttft_deadline is not None:
                self._counts.ttft_deadlines[("met" if now <= request.ttft_deadline else "missed", tenant)] += 1
        else:
            series.itl.observe(now - last)
            series.tpot.observe(now - last)
        self._last_token_time[request.request_id] = now

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None:
        last_token_time = self._last_token_time.pop(request.request_id, None)
        tenant, class_name = self._labels(request.tenant_id), request.priority.value
        series = self._histograms.series(tenant, class_name)
        series.e2e.observe(now - request.arrival_time)
        series.prompt_tokens.observe(event.num_prompt_tokens)
        series.generation_tokens.observe(event.num_output_tokens)
        series.max_generation_tokens.observe(event.num_output_tokens)
        self._counts.finished[(event.finish_reason or "error", tenant, class_name)] += 1  # set: the event is final
        _observe_phases(series, request, last_token_time)
        log_finished(request, event, now)


def _observe_phases(series: _RequestSeries, request: Request, last_token_time: float | None) -> None:
    """vLLM's phases: queued until first scheduled, prefill until the first token, decode until the
    last. A phase the request never reached is not observed."""
    scheduled, first_token = request.first_scheduled_time, request.first_token_time
    if scheduled is None:
        return
    series.queue.observe(scheduled - request.arrival_time)
    if first_token is None or last_token_time is None:
        return
    series.prefill.observe(first_token - scheduled)
    series.decode.observe(last_token_time - first_token)
    series.inference.observe(last_token_time - scheduled)


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


class _Families:
    """Makes metric families whose every series starts with the model_name label (then, for a
    replica's engine state on a cluster's ingress, its replica label)."""

    def __init__(self, model_name: str, more_leading: tuple[tuple[str, str], ...] = ()) -> None:
        self.model_name = model_name
        self._leading = (("model_name", model_name), *more_leading)  # (label, value) every series starts with

    def labelled(self, *labels: tuple[str, str]) -> _Families:
        """These families with more leading labels, (label, value) each."""
        return _Families(self.model_name, (*self._leading[1:], *labels))

    def gauge(self, name: str, what: str, *labels: str) -> _Family:
        return self._family(GaugeMetricFamily, name, what, labels)

    def counter(self, name: str, what: str, *labels: str) -> _Family:
        return self._family(CounterMetricFamily, name, what, labels)

    def _family(self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, what: str,
                labels: tuple[str, ...]) -> _Family:
        names = [label for label, _ in self._leading]
        return _Family(kind(PREFIX + name, what, labels=[*names, *labels]), tuple(v for _, v in self._leading))


@dataclass(slots=True)
class _Family:
    metric: GaugeMetricFamily | CounterMetricFamily
    leading_values: tuple[str, ...]  # model_name's value, then any other leading label's

    def add(self, value: float, *label_values: str) -> _Family:
        self.metric.add_metric([*self.leading_values, *label_values], value)
        return self


def _by_tenant_and_class(gauge: _Family, values: Mapping[str, Mapping[str, float]]) -> _Family:
    """The gauge (labelled tenant, class) filled from class name -> tenant -> value."""
    for class_name, by_tenant in values.items():
        for tenant, value in by_tenant.items():
            gauge.add(value, tenant, class_name)
    return gauge


def merged(families: Iterable[Metric]) -> list[Metric]:
    """One family per name, in order of first appearance: the same families made for several
    replicas, each replica's series added to the first one's."""
    by_name: dict[str, Metric] = {}
    for family in families:
        first = by_name.setdefault(family.name, family)
        if first is not family:
            first.samples.extend(family.samples)
    return list(by_name.values())


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


@dataclass(slots=True, frozen=True)
class ReplicaState:
    """What a cluster's ingress shows of one replica: its scheduler's snapshot, its role (colocated,
    prefill or decode: cluster/handoff.py) and its KV hand-off counters (cluster/replica.py)."""

    snapshot: SchedulerSnapshot
    role: str = "colocated"
    handoff: Mapping[str, float] = field(default_factory=dict)


# On a cluster's ingress: each live replica's latest snapshot (or state), by replica id.
ReplicaSnapshots = Callable[[], Mapping[str, SchedulerSnapshot | ReplicaState]]

# The KV hand-off counters of a replica (cluster.replica.HandoffCounters' fields): metric name, text.
HANDOFF_COUNTERS = {
    "published": ("kv_handoff_prompts_published", "Prompts whose KV blocks a prefill replica published."),
    "publish_failures": ("kv_handoff_publish_failures", "Prompts a prefill replica could not publish."),
    "publish_seconds": ("kv_handoff_publish_seconds", "Seconds prefill replicas waited for their KV writes."),
    "received": ("kv_handoff_received", "Hand-offs a decode replica received."),
    "blocks_received": ("kv_handoff_blocks_received", "KV blocks a decode replica received."),
    "blocks_missed": ("kv_handoff_blocks_missed", "Published KV blocks a decode replica could not read "
                                                  "(computed again)."),
    "fetch_seconds": ("kv_handoff_fetch_seconds", "Seconds decode replicas spent receiving KV blocks."),
}


class EngineCollector(Collector):
    """Gauges and counters computed from the scheduler's snapshot and the plain counters when scraped.
    With `replica_snapshots` (a cluster's ingress, whose own scheduler never steps) the engine's state
    comes from each replica's snapshot instead, every series labelled with its `replica`."""

    def __init__(self, snapshot: Callable[[], SchedulerSnapshot], labels: TenantLabels, counts: RequestCounts,
                 model_name: str, replica_snapshots: ReplicaSnapshots | None = None) -> None:
        self._snapshot = snapshot
        self._replica_snapshots = replica_snapshots
        self._labels = labels
        self._counts = counts
        self._families = _Families(model_name)

    def collect(self) -> Iterator[Metric]:
        yield from merged(family.metric for family in self._engine_states())
        for family in (*self._request_counters(), *self._batch_jobs()):
            yield family.metric

    def _engine_states(self) -> Iterator[_Family]:
        if self._replica_snapshots is None:
            yield from self._engine_state(self._snapshot(), self._families)
            return
        for replica_id, reported in sorted(self._replica_snapshots().items()):
            state = reported if isinstance(reported, ReplicaState) else ReplicaState(reported)
            families = self._families.labelled(("replica", replica_id), ("role", state.role))
            yield from self._engine_state(state.snapshot, families)
            for key, (name, what) in HANDOFF_COUNTERS.items():
                if key in state.handoff:
                    yield families.counter(name, what).add(state.handoff[key])

    def _engine_state(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        yield from self._requests(snapshot, families)
        yield from self._memory(snapshot, families)
        yield from self._scheduler_counters(snapshot, families)
        yield from self._step_cost(snapshot, families)
        yield from self._speculation(snapshot, families)

    def _requests(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        by_class = requests_by_class(snapshot)
        for state, what in (("running", "running"), ("waiting", "waiting to be scheduled"),
                            ("swapped", "preempted, their KV in the CPU swap pool")):
            gauge = families.gauge(f"num_requests_{state}", f"Requests {what}.", "class")
            for class_name, counts in by_class.items():
                gauge.add(counts[state], class_name)
            yield gauge
        waiting = families.gauge("tenant_requests_waiting", "Requests waiting, by tenant and class.", "tenant", "class")
        yield _by_tenant_and_class(waiting, queued_by_tenant(snapshot, self._labels))
        vtc = families.gauge("tenant_vtc_counter", "Virtual token counter of each tenant and class.", "tenant", "class")
        yield _by_tenant_and_class(vtc, vtc_counters(snapshot, self._labels))

    def _memory(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        kv, cpu = snapshot.kv_blocks.fraction, snapshot.cpu_blocks.fraction
        gauge = families.gauge
        yield gauge("kv_cache_usage_perc", "Share of device KV blocks in use, 0 to 1.").add(kv)
        yield gauge("cpu_swap_usage_perc", "Share of CPU swap-pool blocks in use, 0 to 1.").add(cpu)
        # vLLM's older names of the two, which its published dashboard still queries.
        yield gauge("gpu_cache_usage_perc", "Share of device KV blocks in use, 0 to 1 (vLLM's older name).").add(kv)
        yield gauge("cpu_cache_usage_perc", "Share of CPU swap-pool blocks in use, 0 to 1 (vLLM's older name)."
                    ).add(cpu)

    @staticmethod
    def _tiers(snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        """The prefix cache's host and disk tiers, a `tier` label each (absent when none is set)."""
        if not snapshot.tiers:
            return
        blocks = families.gauge("prefix_cache_tier_blocks", "Blocks kept in a lower tier of the prefix cache.", "tier")
        stored = families.gauge("prefix_cache_tier_bytes", "Bytes kept in a lower tier of the prefix cache.", "tier")
        counts = {what: families.counter(f"prefix_cache_tier_{what}", text, "tier") for what, text in (
            ("hits", "Blocks found in a tier and copied up (host) or read (disk) for a request."),
            ("writes", "Blocks written into a tier."), ("evictions", "Blocks evicted from a tier."),
            ("lost", "Blocks a tier could not keep or read back (dropped or failed writes, failed reads)."))}
        for name, tier in snapshot.tiers.items():
            blocks.add(tier.blocks, name)
            stored.add(tier.blocks * snapshot.bytes_per_block, name)
            for what, family in counts.items():
                family.add(getattr(tier, what), name)
        yield blocks
        yield stored
        yield from counts.values()

    def _scheduler_counters(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        counter = families.counter
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
                      ).add(snapshot.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").add(snapshot.prefix_hit_tokens)
        preemptions = counter("num_preemptions", "Requests preempted, by mode.", "mode")
        for mode, count in snapshot.preemptions.items():
            preemptions.add(count, mode)
        yield preemptions
        yield from self._tiers(snapshot, families)
        swap = counter("swap_bytes", "KV bytes copied between device and CPU pools.", "direction")
        swap.add(snapshot.blocks_swapped_out * snapshot.bytes_per_block, "out")
        yield swap.add(snapshot.blocks_swapped_in * snapshot.bytes_per_block, "in")

    def _step_cost(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        """The step cost model and step shaping (scheduling/step_shaper.py); NaN before the model is fitted."""
        cost, gauge, counter = snapshot.step_cost, families.gauge, families.counter
        yield gauge("step_time_predicted_seconds", "The last step's time as the cost model predicted it."
                    ).add(_or_nan(cost.predicted_s))
        yield gauge("step_time_measured_seconds", "The last step's measured time, schedule to events.").add(
            _or_nan(cost.measured_s))
        yield gauge("step_cost_model_error", "Median |predicted - measured| / measured over recent steps."
                    ).add(_or_nan(cost.median_error))
        yield counter("shaped_steps", "Steps whose batch work was held to the interactive latency target."
                      ).add(cost.shaped_steps)
        yield counter("batch_tokens_deferred", "Batch tokens that fit a step's token budget but not its time."
                      ).add(cost.batch_tokens_deferred)
        yield counter("itl_target_missed_steps", "Steps whose interactive work alone was predicted past the "
                      "fixed ITL target.").add(cost.itl_target_missed_steps)

    def _speculation(self, snapshot: SchedulerSnapshot, families: _Families) -> Iterator[_Family]:
        """vLLM's spec_decode counters, by tenant; absent while speculative decoding is off."""
        stats = snapshot.speculation
        if stats is None:
            return
        counter = families.counter
        drafts = counter("spec_decode_num_drafts", "Decodes that verified proposed tokens.", "tenant")
        proposed = counter("spec_decode_num_draft_tokens", "Proposed tokens verified.", "tenant")
        accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", "tenant")
        for tenant, (num_drafts, num_proposed, num_accepted) in sorted(stats.by_tenant.items()):
            label = self._labels(tenant)
            drafts.add(num_drafts, label)
            proposed.add(num_proposed, label)
            accepted.add(num_accepted, label)
        per_position = counter("spec_decode_num_accepted_tokens_per_pos",
                               "Proposed tokens accepted, by their position in the proposal.", "position")
        for position, count in enumerate(stats.accepted_per_position):
            per_position.add(count, str(position))
        yield from (drafts, proposed, accepted, per_position)

    def _request_counters(self) -> Iterator[_Family]:
        counts = self._counts
        for name, counter, what in (("prompt_tokens", counts.prompt_tokens, "Prompt tokens prefilled."),
                                    ("generation_tokens", counts.generation_tokens, "Tokens generated.")):
            family = self._families.counter(name, what, "tenant")
            for tenant in self._labels.present(counter):
                family.add(counter[tenant], tenant)
            yield family
        rejected = self._families.counter("requests_rejected", "Requests turned away, by reason and tenant.",
                                          "reason", "tenant")
        for (reason, tenant), value in sorted(counts.rejected.items()):
            rejected.add(value, reason, tenant)
        yield rejected
        deadlines = self._families.counter("ttft_deadlines", "First tokens of requests with a TTFT deadline "
                                           "(the request's or its tenant's target), met or missed.",
                                           "outcome", "tenant")
        for (outcome, tenant), value in sorted(counts.ttft_deadlines.items()):
            deadlines.add(value, outcome, tenant)
        yield deadlines
        yield self._finished()

    def _finished(self) -> _Family:
        """Every known tenant and class at every finish reason, zeros included, so that rate() sees
        a series' first increase (vLLM also creates each finish reason's series up front)."""
        finished = self._counts.finished
        family = self._families.counter("request_success", "Requests finished, by finish reason, tenant and class.",
                                        "finished_reason", "tenant", "class")
        tenants = self._labels.present(Counter(tenant for _, tenant, _ in finished))  # keys, not counts
        for reason in FINISH_REASONS:
            for tenant in tenants:
                for class_name in CLASS_NAMES:
                    family.add(finished[(reason, tenant, class_name)], reason, tenant, class_name)
        return family

    def _batch_jobs(self) -> Iterator[_Family]:
        jobs = self._counts.batch_jobs
        if jobs is None:
            return
        family = self._families.gauge("batch_jobs", "Batches of the Batch API, by status and tenant.",
                                      "status", "tenant")
        for tenant in self._labels.present(Counter(tenant for tenant, _ in jobs)):
            for status in BATCH_STATUSES:
                family.add(jobs[(tenant, status)], status, tenant)
        yield family


class ServingMetrics:
    """The metrics of one app: its registry, the engine observer, and the rejection counter."""

    def __init__(self, snapshot: Callable[[], SchedulerSnapshot], tenants: TenantRegistry,
                 options: MetricsOptions | None = None, replica_snapshots: ReplicaSnapshots | None = None) -> None:
        options = options or MetricsOptions()
        self.registry = CollectorRegistry()
        self.labels = TenantLabels(tenants)
        self.counts = RequestCounts()
        self.observer = RequestObserver(RequestHistograms(self.registry, options), self.labels, self.counts)
        self.registry.register(EngineCollector(snapshot, self.labels, self.counts, options.model_name,
                                               replica_snapshots))
        self._exposed = WithAliases(self.registry, options.alias_prefixes)

    def record_rejection(self, reason: RejectionReason, tenant_id: str | None = None) -> None:
        """Count a request the HTTP layer turned away; tenant_id None when the caller is not known."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {REJECTION_REASONS}")
        self.counts.rejected[(reason, self.labels(tenant_id))] += 1

    def set_batch_jobs(self, by_tenant_and_status: Mapping[tuple[str, str], int]) -> None:
        """The Batch API's batches by (tenant id, status), as its store counts them now."""
        jobs: Counter[tuple[str, str]] = Counter()
        for (tenant_id, status), count in by_tenant_and_status.items():
            jobs[(self.labels(tenant_id), status)] += count
        self.counts.batch_jobs = jobs

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (under each alias prefix too)."""
        return generate_latest(self._exposed)


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
