"""Admission limits: requests in flight, the tokens-per-minute bucket, prompt length; a virtual clock."""

from __future__ import annotations

import pytest

from tenancy.quotas import QuotaExceeded, TenantQuotas
from tenancy.tenants import Tenant, TenantId, TenantLimits, TenantRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quotas_for(limits: TenantLimits) -> tuple[TenantQuotas, Tenant, Clock]:
    tenant = Tenant(TenantId("t"), limits=limits)
    clock = Clock()
    return TenantQuotas(TenantRegistry([tenant], requires_auth=False), clock), tenant, clock


def test_requests_in_flight_limit_is_concurrent_plus_queued() -> None:
    quotas, tenant, _ = quotas_for(TenantLimits(max_concurrent=2, max_queued=1))
    held = [quotas.admit(tenant, 10, 10) for _ in range(3)]
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(tenant, 10, 10)
    assert refused.value.status == 429
    assert refused.value.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.value.headers["retry-after"]) >= 1
    quotas.release(held[0], 20)
    quotas.release(held[0], 20)  # a second release changes nothing
    assert quotas.in_flight("t") == 2
    quotas.admit(tenant, 10, 10)


def test_token_bucket_charges_then_refunds_unused_tokens() -> None:
    quotas, tenant, clock = quotas_for(TenantLimits(tokens_per_minute=600))
    first = quotas.admit(tenant, 100, 400)  # 500 charged, 100 left
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit(tenant, 100, 100)
    assert refused.value.status == 429
    # 200 wanted, 100 there, 10 tokens/s refill: 10 s.
    assert refused.value.headers["retry-after"] == "10"
    assert refused.value.headers["x-ratelimit-limit-tokens"] == "600"
    assert refused.value.headers["x-ratelimit-remaining-tokens"] == "100"
    quotas.release(first, 150)  # used 150 of 500: 350 back
    second = quotas.admit(tenant, 100, 100)
    assert second.headers["x-ratelimit-remaining-tokens"] == "250"
    clock.now += 60
    assert quotas.admit(tenant, 300, 300).charged_tokens == 600


def test_requests_that_can_never_fit_get_400() -> None:
    quotas, tenant, _ = quotas_for(TenantLimits(tokens_per_minute=100, max_prompt_tokens=50))
    with pytest.raises(QuotaExceeded) as too_long:
        quotas.admit(tenant, 51, 1)
    assert too_long.value.status == 400 and "50" in too_long.value.message
    with pytest.raises(QuotaExceeded) as too_many:
        quotas.admit(tenant, 50, 60)
    assert too_many.value.status == 400 and "110" in too_many.value.message


def test_unlimited_tenant_is_never_refused() -> None:
    quotas, tenant, _ = quotas_for(TenantLimits())
    for _ in range(100):
        admission = quotas.admit(tenant, 4000, 4000)
        assert admission.headers == {}
