"""The metrics vLLM's dashboard queries, their meaning and buckets; `model_name` on every series; the
`vllm:` aliases; batch jobs by status. Read back from the exposition format, as in test_metrics."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.observability.metric_names import TPOT_BUCKETS, MetricsOptions, token_count_buckets
from app.observability.metrics import BATCH_STATUSES, FINISH_REASONS, ServingMetrics
from app.observability.routes import Observability
from benchmarks.fake_executors import FakeExecutor
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.app.test_metrics import BATCH, INTERACTIVE, TWO_TENANTS, WORKLOAD, Scrape, run_workload, series
from tests.factories import collect, make_geometry, make_request, make_scheduler, run_step, running

MODEL = "tiny-model"
# vLLM's buckets for time per output token (vllm/v1/metrics/loggers.py).
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0]


def engine_with(options: MetricsOptions) -> tuple[Engine, Observability]:
    executor = FakeExecutor(make_geometry(num_device_blocks=64, block_size=4))
    engine = Engine(Scheduler(SchedulerConfig(), executor.geometry, TWO_TENANTS), executor)
    return engine, Observability.attach(engine, options=options)


def scrape(observability: Observability) -> Scrape:
    return Scrape.parse(observability.metrics.exposition().decode(), MODEL)


def bucket_bounds(scrape: Scrape, name: str, labels: dict[str, str]) -> list[float]:
    bounds = [float(dict(key)["le"]) for sample, key in scrape.samples
              if sample == name + "_bucket" and frozenset(labels.items()) <= key]
    return sorted(bounds)


async def test_vllm_request_metrics_by_tenant_and_class() -> None:
    engine, observability = engine_with(MetricsOptions(model_name=MODEL, max_model_len=64))
    await run_workload(engine)
    after = scrape(observability)

    for tenant, priority in [("alice", INTERACTIVE), ("alice", BATCH), ("bob", INTERACTIVE), ("bob", BATCH),
                             ("unknown", INTERACTIVE)]:
        label_tenant = {"unknown": "mallory"}.get(tenant, tenant)
        mine = [(p, m) for t, c, p, m in WORKLOAD if t == label_tenant and c is priority]
        labels = series(tenant, priority)

        def total(name: str, labels: dict[str, str] = labels) -> float:
            return after.value(f"fairlane:{name}_sum", labels)

        assert after.value("fairlane:time_per_output_token_seconds_count", labels) == sum(m - 1 for _, m in mine)
        assert total("time_per_output_token_seconds") == pytest.approx(total("inter_token_latency_seconds"))
        assert total("request_prompt_tokens") == sum(p for p, _ in mine)
        assert total("request_generation_tokens") == sum(m for _, m in mine)
        assert total("request_max_num_generation_tokens") == sum(m for _, m in mine)
        for phase in ("prefill", "decode", "inference"):
            assert after.value(f"fairlane:request_{phase}_time_seconds_count", labels) == len(mine)
        # vLLM's phases add up: queued + prefill = time to first token, prefill + decode = inference.
        assert total("request_queue_time_seconds") + total("request_prefill_time_seconds") == pytest.approx(
            total("time_to_first_token_seconds"))
        assert total("request_prefill_time_seconds") + total("request_decode_time_seconds") == pytest.approx(
            total("request_inference_time_seconds"))
        assert total("request_inference_time_seconds") <= total("e2e_request_latency_seconds")
        for reason in FINISH_REASONS:
            expected = len(mine) if reason == "length" else 0
            assert after.value("fairlane:request_success_total", {"finished_reason": reason, **labels}) == expected

    assert bucket_bounds(after, "fairlane:time_per_output_token_seconds", series("alice", BATCH)) == [
        *VLLM_TPOT_BUCKETS, float("inf")]
    assert bucket_bounds(after, "fairlane:request_prompt_tokens", series("alice", BATCH)) == [
        1, 2, 5, 10, 20, 50, float("inf")]
    assert after.types["fairlane:request_success"] == "counter"
    assert after.types["fairlane:request_prompt_tokens"] == "histogram"


def test_vllm_bucket_definitions() -> None:
    assert list(TPOT_BUCKETS) == VLLM_TPOT_BUCKETS
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(4096)[-1] == 2000


async def test_an_aborted_request_counts_as_abort_without_phases() -> None:
    engine, observability = engine_with(MetricsOptions(model_name=MODEL))
    request = make_request(6, 3, tenant_id="bob", priority=INTERACTIVE, arrival_time=time.monotonic())
    async with running(engine):
        stream = engine.submit(request)
        stream.close()  # before the engine ever schedules it
        await collect(stream)
    after = scrape(observability)

    labels = series("bob", INTERACTIVE)
    assert after.value("fairlane:request_success_total", {"finished_reason": "abort", **labels}) == 1
    assert after.value("fairlane:e2e_request_latency_seconds_count", labels) == 1
    assert after.value("fairlane:request_generation_tokens_sum", labels) == 0
    assert after.get("fairlane:request_prefill_time_seconds_count", labels) == 0


def test_cache_gauges_under_vllms_names_and_queues_by_tenant() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=1), num_device_blocks=16, block_size=4,
                               tenants=TWO_TENANTS)
    metrics = ServingMetrics(scheduler.snapshot, scheduler.tenants)
    for tenant, priority in [("alice", INTERACTIVE), ("bob", INTERACTIVE), ("bob", BATCH), ("bob", BATCH)]:
        scheduler.add_request(make_request(8, 4, tenant_id=tenant, priority=priority))
    run_step(scheduler, FakeExecutor(scheduler.geometry))

    now = Scrape.parse(metrics.exposition().decode())  # model_name "default" when none is given
    assert now.value("fairlane:gpu_cache_usage_perc") == now.value("fairlane:kv_cache_usage_perc") == 2 / 16
    assert now.value("fairlane:cpu_cache_usage_perc") == now.value("fairlane:cpu_swap_usage_perc") == 0
    waiting = {(t, c): now.value("fairlane:tenant_requests_waiting", {"tenant": t, "class": c})
               for t in ("alice", "bob") for c in ("interactive", "batch")}
    assert waiting == {("alice", "interactive"): 0, ("bob", "interactive"): 1, ("alice", "batch"): 0,
                       ("bob", "batch"): 2}


async def test_vllm_names_repeat_every_family() -> None:
    engine, observability = engine_with(MetricsOptions(model_name=MODEL, names="vllm"))
    await run_workload(engine)
    observability.metrics.record_rejection("rate_limit", "alice")
    text = observability.metrics.exposition().decode()

    families = {family.name: family for family in text_string_to_metric_families(text)}
    ours = {name for name in families if name.startswith("fairlane:")}
    theirs = {name for name in families if name.startswith("vllm:")}
    assert theirs == {"vllm:" + name.removeprefix("fairlane:") for name in ours}
    assert ours | theirs == set(families)
    for name in ours:
        alias = families["vllm:" + name.removeprefix("fairlane:")]
        assert alias.type == families[name].type
        # repr, so that a NaN (a gauge with nothing to report yet) equals the NaN of its alias
        assert [(s.name.removeprefix("vllm:"), s.labels, repr(s.value)) for s in alias.samples] == [
            (s.name.removeprefix("fairlane:"), s.labels, repr(s.value)) for s in families[name].samples]
    assert Scrape.parse(text, MODEL).value("vllm:time_per_output_token_seconds_count", series("bob", BATCH)) > 0


def test_fairlane_names_alone_by_default() -> None:
    scheduler = make_scheduler(tenants=TWO_TENANTS)
    text = ServingMetrics(scheduler.snapshot, scheduler.tenants).exposition().decode()
    assert "vllm:" not in text


def test_batch_jobs_by_status_and_bounded_tenant() -> None:
    scheduler = make_scheduler(tenants=TWO_TENANTS)
    metrics = ServingMetrics(scheduler.snapshot, scheduler.tenants)
    assert not any(name.startswith("fairlane:batch_jobs") for name, _ in Scrape.parse(
        metrics.exposition().decode()).samples)  # an app without a Batch API has no such family

    metrics.set_batch_jobs({("alice", "completed"): 2, ("alice", "in_progress"): 1, ("mallory", "failed"): 1,
                            ("eve", "failed"): 2})
    after = Scrape.parse(metrics.exposition().decode())
    assert after.value("fairlane:batch_jobs", {"status": "completed", "tenant": "alice"}) == 2
    assert after.value("fairlane:batch_jobs", {"status": "in_progress", "tenant": "alice"}) == 1
    assert after.value("fairlane:batch_jobs", {"status": "failed", "tenant": "unknown"}) == 3
    for status in BATCH_STATUSES:  # every status of every known tenant, zeros included
        assert after.get("fairlane:batch_jobs", {"status": status, "tenant": "bob"}) == 0
