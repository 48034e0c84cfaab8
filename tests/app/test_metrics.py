"""Prometheus metrics and the request log: values read back from the exposition format.

Tenant-labelled metrics are driven through an engine with two registered tenants (the HTTP layer
serves a single tenant until it authenticates callers); the rest through a real server.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.observability.metrics import REJECTION_REASONS, RejectionReason, ReplicaState, ServingMetrics, rejection_reason
from app.observability.routes import Observability
from benchmarks.fake_executors import FakeExecutor
from scheduling.engine import Engine
from scheduling.request import PriorityClass, Request
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry
from tests.app.conftest import ServerThread
from tests.factories import collect, make_geometry, make_request, make_scheduler, run_step, run_to_completion, running

INTERACTIVE, BATCH = PriorityClass.INTERACTIVE, PriorityClass.BATCH
TWO_TENANTS = TenantRegistry([Tenant(TenantId("alice")), Tenant(TenantId("bob"), weight=2.0)], requires_auth=True)
TTFT = "fairlane:time_to_first_token_seconds"
ITL = "fairlane:inter_token_latency_seconds"
E2E = "fairlane:e2e_request_latency_seconds"
QUEUE = "fairlane:request_queue_time_seconds"


@dataclass(frozen=True)
class Scrape:
    """One parsed exposition: sample values by name and labels, and each family's type."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    types: dict[str, str]

    @classmethod
    def parse(cls, text: str, model_name: str = "default") -> Scrape:
        """Every sample must carry model_name (as in vLLM); it is checked here and left out of the keys."""
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for sample in family.samples:
                labels = dict(sample.labels)
                assert labels.pop("model_name", None) == model_name, (sample.name, sample.labels)
                samples[(sample.name, frozenset(labels.items()))] = sample.value
        return cls(samples, types)

    def get(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        return self.samples.get((name, frozenset((labels or {}).items())))

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        found = self.get(name, labels)
        if found is None:
            present = [dict(k) for n, k in self.samples if n == name]
            raise AssertionError(f"no sample {name}{dict(labels or {})}; present: {present}")
        return found

    def label_values(self, label: str) -> set[str]:
        return {v for _, labels in self.samples for k, v in labels if k == label}


def scrape(metrics: ServingMetrics) -> Scrape:
    return Scrape.parse(metrics.exposition().decode())


def series(tenant: str, priority: PriorityClass) -> dict[str, str]:
    return {"tenant": tenant, "class": priority.value}


def observed_engine(tenants: TenantRegistry = TWO_TENANTS) -> tuple[Engine, Observability]:
    executor = FakeExecutor(make_geometry(num_device_blocks=64, block_size=4))
    engine = Engine(Scheduler(SchedulerConfig(), executor.geometry, tenants), executor)
    return engine, Observability.attach(engine)


def timed_request(prompt: int, max_tokens: int, tenant: str, priority: PriorityClass) -> Request:
    """A request that arrives now (the factory's arrival ticks are not clock readings)."""
    return make_request(prompt, max_tokens, tenant_id=tenant, priority=priority, arrival_time=time.monotonic())


# (tenant, class, prompt tokens, max_tokens): two tenants, both classes, and a caller the registry does not know.
WORKLOAD = [("alice", INTERACTIVE, 8, 4), ("alice", BATCH, 12, 3), ("bob", INTERACTIVE, 5, 2),
            ("bob", BATCH, 6, 5), ("bob", BATCH, 7, 2), ("mallory", INTERACTIVE, 9, 3)]


async def run_workload(engine: Engine) -> None:
    async with running(engine):
        streams = [engine.submit(timed_request(prompt, max_tokens, tenant, priority))
                   for tenant, priority, prompt, max_tokens in WORKLOAD]
        for stream in streams:
            await collect(stream)


async def test_latency_histograms_and_token_counters_by_tenant_and_class() -> None:
    engine, observability = observed_engine()
    before = scrape(observability.metrics)
    assert before.get(E2E + "_count", series("alice", INTERACTIVE)) is None
    assert before.value("fairlane:generation_tokens_total", {"tenant": "alice"}) == 0

    await run_workload(engine)
    after = scrape(observability.metrics)

    for tenant, priority in [("alice", INTERACTIVE), ("alice", BATCH), ("bob", INTERACTIVE), ("bob", BATCH),
                             ("unknown", INTERACTIVE)]:
        label_tenant = {"unknown": "mallory"}.get(tenant, tenant)
        mine = [(p, m) for t, c, p, m in WORKLOAD if t == label_tenant and c is priority]
        labels = series(tenant, priority)
        for name in (TTFT, E2E, QUEUE):
            assert after.value(name + "_count", labels) == len(mine), (name, labels)
        assert after.value(ITL + "_count", labels) == sum(m - 1 for _, m in mine)
        # Per request queue time <= time to first token <= end to end, so the sums are ordered too.
        assert 0 <= after.value(QUEUE + "_sum", labels) <= after.value(TTFT + "_sum", labels)
        assert after.value(TTFT + "_sum", labels) <= after.value(E2E + "_sum", labels)
        assert after.value(E2E + "_bucket", {**labels, "le": "+Inf"}) == len(mine)
    for tenant in ("alice", "bob", "unknown"):
        label_tenant = {"unknown": "mallory"}.get(tenant, tenant)
        mine = [(p, m) for t, _, p, m in WORKLOAD if t == label_tenant]
        assert after.value("fairlane:prompt_tokens_total", {"tenant": tenant}) == sum(p for p, _ in mine)
        assert after.value("fairlane:generation_tokens_total", {"tenant": tenant}) == sum(m for _, m in mine)
    assert after.label_values("tenant") == {"alice", "bob", "unknown"}
    assert after.types["fairlane:generation_tokens"] == "counter"
    assert after.types[TTFT] == "histogram"


async def test_scheduler_state_is_read_at_scrape_time() -> None:
    engine, observability = observed_engine()
    await run_workload(engine)
    after = scrape(observability.metrics)

    for priority in (INTERACTIVE, BATCH):
        for state in ("running", "waiting", "swapped"):
            assert after.value(f"fairlane:num_requests_{state}", {"class": priority.value}) == 0
    assert after.value("fairlane:kv_cache_usage_perc") == 0
    # Every prompt was looked up once; nothing was shared (the prompts differ).
    assert after.value("fairlane:prefix_cache_queries_total") == sum(p for _, _, p, _ in WORKLOAD)
    assert after.value("fairlane:prefix_cache_hits_total") == 0
    vtc = {(t, c): after.value("fairlane:tenant_vtc_counter", {"tenant": t, "class": c})
           for t in ("alice", "bob") for c in ("interactive", "batch")}
    assert all(value > 0 for value in vtc.values()), vtc
    # The registry's tenants only: the unknown caller's counter is not a label value.
    assert after.get("fairlane:tenant_vtc_counter", {"tenant": "unknown", "class": "interactive"}) is None


async def test_step_time_and_shaping_series() -> None:
    engine, observability = observed_engine()
    before = scrape(observability.metrics)
    assert math.isnan(before.value("fairlane:step_time_measured_seconds"))
    assert before.value("fairlane:batch_tokens_deferred_total") == 0

    async with running(engine):  # enough steps for the cost model to fit
        for stream in [engine.submit(timed_request(8, 24, "alice", priority)) for priority in (INTERACTIVE, BATCH)]:
            await collect(stream)
        after = scrape(observability.metrics)

    stats = engine.stats()["step_cost"]
    assert after.value("fairlane:step_time_measured_seconds") == stats["measured_s"] > 0
    assert after.value("fairlane:step_time_predicted_seconds") == stats["predicted_s"] >= 0
    assert after.value("fairlane:step_cost_model_error") == stats["median_error"] >= 0
    assert after.value("fairlane:shaped_steps_total") == stats["shaped_steps"]
    assert after.types["fairlane:batch_tokens_deferred"] == "counter"


def test_queue_and_kv_gauges_while_requests_wait() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=1), num_device_blocks=16, block_size=4,
                               tenants=TWO_TENANTS)
    metrics = ServingMetrics(scheduler.snapshot, scheduler.tenants)
    for tenant, priority in [("alice", INTERACTIVE), ("bob", INTERACTIVE), ("alice", BATCH)]:
        scheduler.add_request(make_request(8, 4, tenant_id=tenant, priority=priority))
    run_step(scheduler, FakeExecutor(scheduler.geometry))

    now = scrape(metrics)
    assert now.value("fairlane:num_requests_running", {"class": "interactive"}) == 1
    assert now.value("fairlane:num_requests_waiting", {"class": "interactive"}) == 1
    assert now.value("fairlane:num_requests_waiting", {"class": "batch"}) == 1
    # The running prompt's 8 tokens fill 2 blocks of 4; the sampled token gets its slot next step.
    assert now.value("fairlane:kv_cache_usage_perc") == 2 / 16


def test_preemption_and_swap_counters() -> None:
    """Two batch requests fill the device pool; an interactive one makes the newest swap out."""
    scheduler = make_scheduler(num_device_blocks=8, num_cpu_blocks=16, block_size=4)
    executor = FakeExecutor(scheduler.geometry)
    metrics = ServingMetrics(scheduler.snapshot, scheduler.tenants)
    scheduler.add_request(make_request(16, 8, priority=BATCH))
    scheduler.add_request(make_request(12, 8, priority=BATCH))
    run_step(scheduler, executor)
    scheduler.add_request(make_request(12, 2, priority=INTERACTIVE))
    run_step(scheduler, executor)

    during = scrape(metrics)
    bytes_per_block = scheduler.geometry.bytes_per_block
    assert during.value("fairlane:num_preemptions_total", {"mode": "swap"}) == 1
    assert during.value("fairlane:num_preemptions_total", {"mode": "recompute"}) == 0
    assert during.value("fairlane:swap_bytes_total", {"direction": "out"}) == 3 * bytes_per_block
    assert during.value("fairlane:num_requests_swapped", {"class": "batch"}) == 1
    assert during.value("fairlane:cpu_swap_usage_perc") == 3 / 16
    assert during.value("fairlane:kv_cache_usage_perc") == 1.0

    run_to_completion(scheduler, executor)
    done = scrape(metrics)
    assert done.value("fairlane:swap_bytes_total", {"direction": "in"}) == done.value(
        "fairlane:swap_bytes_total", {"direction": "out"})
    assert done.value("fairlane:num_requests_swapped", {"class": "batch"}) == 0
    assert done.value("fairlane:cpu_swap_usage_perc") == 0


def test_a_cluster_ingress_shows_each_replicas_engine_state_labelled_by_replica() -> None:
    ingress, busy, idle = (make_scheduler(tenants=TWO_TENANTS) for _ in range(3))
    busy.add_request(make_request(8, 4, tenant_id="alice"))
    run_step(busy, FakeExecutor(busy.geometry))
    metrics = ServingMetrics(ingress.snapshot, ingress.tenants,
                             replica_snapshots=lambda: {"r2": idle.snapshot(), "r1": ReplicaState(
                                 busy.snapshot(), "decode", {"blocks_received": 12, "fetch_seconds": 0.5})})

    text = metrics.exposition().decode()
    now = Scrape.parse(text)
    r1, r2 = {"replica": "r1", "role": "decode"}, {"replica": "r2", "role": "colocated"}
    assert now.value("fairlane:num_requests_running", {**r1, "class": "interactive"}) == 1
    assert now.value("fairlane:num_requests_running", {**r2, "class": "interactive"}) == 0
    assert now.value("fairlane:kv_cache_usage_perc", r1) == 2 / 64
    assert now.value("fairlane:tenant_vtc_counter", {**r1, "tenant": "alice", "class": "interactive"}) > 0
    assert now.value("fairlane:num_preemptions_total", {"replica": "r2", "role": "colocated", "mode": "swap"}) == 0
    assert now.get("fairlane:num_requests_running", {"class": "interactive"}) is None  # nothing from the ingress's own
    assert now.value("fairlane:kv_handoff_blocks_received_total", {"replica": "r1", "role": "decode"}) == 12
    assert now.get("fairlane:kv_handoff_blocks_received_total", {"replica": "r2", "role": "colocated"}) is None
    assert text.count("# TYPE fairlane:num_requests_running gauge") == 1  # one family, a series per replica
    assert now.get("fairlane:requests_rejected_total", {"replica": "r1", "role": "decode"}) is None


def test_rejections_by_reason_and_bounded_tenant() -> None:
    scheduler = make_scheduler(tenants=TWO_TENANTS)
    metrics = ServingMetrics(scheduler.snapshot, scheduler.tenants)
    metrics.record_rejection("rate_limit", "alice")
    metrics.record_rejection("rate_limit", "alice")
    metrics.record_rejection("unauthorized", None)
    metrics.record_rejection("queue_full", "mallory")

    after = scrape(metrics)
    assert after.value("fairlane:requests_rejected_total", {"reason": "rate_limit", "tenant": "alice"}) == 2
    assert after.value("fairlane:requests_rejected_total", {"reason": "unauthorized", "tenant": "unknown"}) == 1
    assert after.value("fairlane:requests_rejected_total", {"reason": "queue_full", "tenant": "unknown"}) == 1
    assert after.label_values("tenant") <= {"alice", "bob", "unknown"}
    with pytest.raises(ValueError, match="unknown rejection reason"):
        metrics.record_rejection("teapot", "alice")  # type: ignore[arg-type]


@pytest.mark.parametrize(("status", "code", "reason"), [
    (400, "invalid_value", "invalid_request"), (404, "model_not_found", "invalid_request"),
    (413, None, "invalid_request"), (401, None, "unauthorized"), (429, None, "rate_limit"),
    (503, "server_overloaded", "queue_full"), (503, "server_shutting_down", "shutting_down"), (500, None, None),
])
def test_rejection_reason_of_an_error_answer(status: int, code: str | None, reason: RejectionReason | None) -> None:
    assert rejection_reason(status, code) == reason
    assert reason is None or reason in REJECTION_REASONS


def test_each_app_has_its_own_registry() -> None:
    one, two = make_scheduler(), make_scheduler()
    first, second = ServingMetrics(one.snapshot, one.tenants), ServingMetrics(two.snapshot, two.tenants)
    first.record_rejection("invalid_request", "default")
    assert scrape(first).value("fairlane:requests_rejected_total",
                               {"reason": "invalid_request", "tenant": "default"}) == 1
    assert scrape(second).get("fairlane:requests_rejected_total",
                              {"reason": "invalid_request", "tenant": "default"}) is None


# ---- the request log ----------------------------------------------------------------------------

LOG_FIELDS = {"request_id", "tenant", "class", "prompt_tokens", "cached_tokens", "completion_tokens",
              "queue_time_s", "ttft_s", "total_time_s", "preemptions", "finish_reason"}


async def test_one_json_line_per_finished_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fairlane.requests")
    engine, _ = observed_engine()
    finished = timed_request(10, 3, "alice", BATCH)
    aborted = timed_request(6, 3, "bob", INTERACTIVE)
    async with running(engine):
        finished_stream, aborted_stream = engine.submit(finished), engine.submit(aborted)
        aborted_stream.close()  # before the engine ever schedules it
        await collect(finished_stream)
        await collect(aborted_stream)

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "fairlane.requests"]
    assert len(lines) == 2
    by_id: dict[str, dict[str, Any]] = {line["request_id"]: line for line in lines}
    done, gone = by_id[finished.request_id], by_id[aborted.request_id]
    assert set(done) == LOG_FIELDS and set(gone) == LOG_FIELDS  # counts and times only: no text, no keys
    assert (done["tenant"], done["class"], done["finish_reason"]) == ("alice", "batch", "length")
    assert (done["prompt_tokens"], done["cached_tokens"], done["completion_tokens"]) == (10, 0, 3)
    assert done["preemptions"] == 0
    assert 0 <= done["queue_time_s"] <= done["ttft_s"] <= done["total_time_s"]
    assert (gone["finish_reason"], gone["completion_tokens"]) == ("abort", 0)
    assert gone["queue_time_s"] is None and gone["ttft_s"] is None and gone["total_time_s"] >= 0


# ---- over HTTP ----------------------------------------------------------------------------------


def http_scrape(server: ServerThread) -> Scrape:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape.parse(response.text, server.model_name)


def generate(server: ServerThread, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}{path}", json={"model": server.model_name, "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True, **body},
                          timeout=60)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def test_metrics_endpoint_after_requests_of_both_classes(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    before = http_scrape(server)
    assert before.value("fairlane:generation_tokens_total", {"tenant": "default"}) == 0

    chat = {"messages": [{"role": "user", "content": "Name three rivers of Europe, and their lengths in km."}]}
    usages = [generate(server, "/v1/chat/completions", chat), generate(server, "/v1/chat/completions", chat),
              generate(server, "/v1/completions", {"prompt": "Once upon a time", "service_tier": "flex"}),
              generate(server, "/v1/completions", {"prompt": "In a hole in the ground", "service_tier": "flex"})]
    unknown_field = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                               json={"model": server.model_name, "prompt": "x", "colour": "blue"})
    unknown_model = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                               json={"model": "no-such-model", "prompt": "x"})
    assert (unknown_field.status_code, unknown_model.status_code) == (400, 404)

    after = http_scrape(server)
    for priority in (INTERACTIVE, BATCH):
        labels = series("default", priority)
        for name in (TTFT, E2E, QUEUE):
            assert after.value(name + "_count", labels) == 2
        assert after.value(ITL + "_count", labels) == 2 * 3
        assert 0 < after.value(TTFT + "_sum", labels) <= after.value(E2E + "_sum", labels)
        assert after.value("fairlane:num_requests_running", {"class": priority.value}) == 0
    assert after.value("fairlane:generation_tokens_total", {"tenant": "default"}) == 4 * 4
    assert after.value("fairlane:prompt_tokens_total", {"tenant": "default"}) == sum(u["prompt_tokens"] for u in usages)
    assert after.value("fairlane:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the second chat request shares the first one's prompt blocks
    assert after.value("fairlane:prefix_cache_hits_total") == cached
    assert after.value("fairlane:kv_cache_usage_perc") == 0
    assert after.value("fairlane:requests_rejected_total", {"reason": "invalid_request", "tenant": "default"}) == 2
