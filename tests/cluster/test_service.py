"""Fairness across replicas, without Ray: service measured per tenant, exchanged once, folded in."""

from __future__ import annotations

import pytest

from cluster.service import ServiceLedger, ServiceMeter, fold_service
from gpu.plan import CacheGeometry
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import TenantId

GEOMETRY = CacheGeometry(num_device_blocks=64, num_cpu_blocks=0, block_size=16, bytes_per_block=1024,
                         max_model_len=512)


def test_each_replica_gets_the_others_service_exactly_once() -> None:
    ledger = ServiceLedger()
    assert ledger.exchange("r1", {"interactive": {"alice": 10.0}}) == {}
    assert ledger.exchange("r2", {"interactive": {"bob": 4.0}}) == {"interactive": {"alice": 10.0}}
    assert ledger.exchange("r1", {}) == {"interactive": {"bob": 4.0}}
    assert ledger.exchange("r1", {}) == {}
    assert ledger.exchange("r2", {"interactive": {"alice": 1.0}}) == {}


def test_a_replica_counts_prompt_then_each_token_in_vtc_units() -> None:
    scheduler = Scheduler(SchedulerConfig(), GEOMETRY)
    meter = ServiceMeter(scheduler)
    request = Request(RequestId("r"), list(range(20)), 8, tenant_id=TenantId("alice"))
    meter.on_tokens(request, TokenEvent(request.request_id, (1,), None, 20, 1, num_cached_tokens=16), 0.0)
    meter.on_tokens(request, TokenEvent(request.request_id, (2, 3), None, 20, 3, num_cached_tokens=16), 0.0)
    weights = scheduler.vtc[PriorityClass.INTERACTIVE].weights

    expected = weights.prompt * 4 + weights.prompt * weights.cached_prompt * 16 + weights.decode * 3
    assert meter.take() == {"interactive": {"alice": pytest.approx(expected)}}
    assert meter.take() == {}


def test_folded_service_raises_the_tenants_counter() -> None:
    scheduler = Scheduler(SchedulerConfig(), GEOMETRY)
    fold_service(scheduler, {"batch": {"alice": 6.0}})

    assert scheduler.vtc[PriorityClass.BATCH].get("alice") == 6.0
    assert scheduler.vtc[PriorityClass.INTERACTIVE].get("alice") == 0.0
