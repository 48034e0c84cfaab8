"""Fairness across replicas, without Ray: service measured per tenant, exchanged once, folded in."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from benchmarks.fake_executors import FakeExecutor
from cluster.service import ServiceLedger, ServiceMeter
from cluster.wire import ServiceByTenant
from contract.plan import CacheGeometry
from scheduling.request import PriorityClass, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry
from tests.factories import make_request, make_scheduler, run_step

GEOMETRY = CacheGeometry(num_device_blocks=64, num_cpu_blocks=0, block_size=16, bytes_per_block=1024,
                         max_model_len=512)


def add_up(into: defaultdict[tuple[str, str], float], service: ServiceByTenant) -> None:
    for name, by_tenant in service.items():
        for tenant_id, amount in by_tenant.items():
            into[(name, tenant_id)] += amount


def test_each_replica_gets_the_others_service_exactly_once() -> None:
    ledger = ServiceLedger()
    assert ledger.exchange("r1", {"interactive": {"alice": 10.0}}) == {}
    assert ledger.exchange("r2", {"interactive": {"bob": 4.0}}) == {"interactive": {"alice": 10.0}}
    assert ledger.exchange("r1", {}) == {"interactive": {"bob": 4.0}}
    assert ledger.exchange("r1", {}) == {}
    assert ledger.exchange("r2", {"interactive": {"alice": 1.0}}) == {}


def test_a_replica_publishes_a_prompt_chunk_by_chunk_as_it_is_computed() -> None:
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=16))
    executor = FakeExecutor(scheduler.geometry)
    meter = ServiceMeter(scheduler)
    scheduler.add_request(make_request(40, 2, tenant_id="alice"))
    w_p = scheduler.vtc[PriorityClass.INTERACTIVE].weights.prompt

    _, events = run_step(scheduler, executor)

    assert events == []  # no token yet, but the board hears of the prefill already
    assert meter.take() == {"interactive": {"alice": pytest.approx(w_p * 16)}}
    run_step(scheduler, executor)
    assert meter.take() == {"interactive": {"alice": pytest.approx(w_p * 16)}}


def test_a_replica_publishes_exactly_what_its_counters_were_charged() -> None:
    """Prefill chunks, cached prompt tokens and decodes of two tenants of different weights in both
    classes; service folded in from another replica is not published again, and a report that never
    reached the board goes out with the next one."""
    tenants = TenantRegistry([Tenant(TenantId("alice"), 1.0), Tenant(TenantId("bob"), 2.0)], requires_auth=False)
    scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=16), tenants=tenants)
    executor = FakeExecutor(scheduler.geometry)
    meter = ServiceMeter(scheduler)
    first = make_request(40, 5, tenant_id="alice")
    requests = [first, make_request(30, 4, tenant_id="bob", priority=PriorityClass.BATCH),
                make_request(12, 6, tenant_id="bob")]
    for request in requests:  # all at once: no tenant is lifted, so the counters hold charges only
        scheduler.add_request(request)
    published: defaultdict[tuple[str, str], float] = defaultdict(float)
    folded = {"interactive": {"alice": 7.0}, "batch": {"bob": 3.0}}
    last_events: dict[RequestId, TokenEvent] = {}
    for step in itertools.count():
        if not scheduler.has_work():
            break
        _, events = run_step(scheduler, executor)
        last_events.update((e.request_id, e) for e in events)
        if first.request_id in last_events and len(requests) == 3:  # its prompt is cached now
            requests.append(make_request(first.prompt_token_ids, 3, tenant_id="alice"))
            scheduler.add_request(requests[-1])
        if step == 2:
            scheduler.fold_service(folded)
        service = meter.take()
        if step == 4:  # the exchange failed: this service goes out with the next report
            meter.give_back(service)
        else:
            add_up(published, service)
    add_up(published, meter.take())

    charged: defaultdict[tuple[str, str], float] = defaultdict(float)  # what each request's usage is worth
    for request in requests:
        end = last_events[request.request_id]
        charged[(request.priority.value, request.tenant_id)] += scheduler.vtc[request.priority].service(
            end.num_prompt_tokens - end.num_cached_tokens, end.num_output_tokens, end.num_cached_tokens)
    assert last_events[requests[-1].request_id].num_cached_tokens > 0
    assert published == pytest.approx(charged)
    for (name, tenant_id), amount in charged.items():
        counter = scheduler.vtc[PriorityClass(name)].get(tenant_id) * tenants.weight(tenant_id)
        assert counter == pytest.approx(amount + folded[name].get(tenant_id, 0.0))


def test_folded_service_raises_the_tenants_counter() -> None:
    scheduler = Scheduler(SchedulerConfig(), GEOMETRY)
    scheduler.fold_service({"batch": {"alice": 6.0}})

    assert scheduler.vtc[PriorityClass.BATCH].get("alice") == 6.0
    assert scheduler.vtc[PriorityClass.INTERACTIVE].get("alice") == 0.0
