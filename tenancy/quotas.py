"""Per-tenant admission limits: requests in flight and a tokens-per-minute bucket.

A request over a limit is refused with 429 and Retry-After instead of queueing without bound; one
that could never fit (a prompt over max_prompt_tokens, or more tokens than a whole minute's
bucket) is refused with 400. Tokens per minute is a token bucket charged with prompt + max_tokens
at admission and corrected with the tokens really used at completion.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tenancy.tenants import Tenant, TenantRegistry


@dataclass(slots=True)
class TokenBucket:
    """`capacity` units refilled over `window_s` (a minute for the tenants' per-minute limits, a second for
    the rates that shape traffic); `level` may go below zero, a debt the refill pays first."""

    capacity: float
    level: float
    updated: float
    window_s: float = 60.0

    @property
    def refill_per_second(self) -> float:
        return self.capacity / self.window_s

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.refill_per_second)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.refill_per_second)


class QuotaExceeded(Exception):
    """Refused at admission; carries the HTTP status, message and headers to answer with."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers


@dataclass(slots=True)
class Admission:
    """What one admitted request holds; hand it back with `TenantQuotas.release`."""

    tenant: Tenant
    charged_tokens: int
    released: bool = False
    headers: dict[str, str] = field(default_factory=dict)


class TenantQuotas:
    """Tracks requests in flight and token buckets per tenant. Owned by the event loop's thread."""

    def __init__(self, registry: TenantRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._clock = clock
        self._in_flight: Counter[str] = Counter()
        self._buckets: dict[str, TokenBucket] = {}

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight[tenant_id]

    def admit(self, tenant: Tenant, num_prompt_tokens: int, max_tokens: int) -> Admission:
        """Take a slot and the tokens for one request, or raise QuotaExceeded."""
        limits = tenant.limits
        if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
            raise QuotaExceeded(400, f"the prompt has {num_prompt_tokens} tokens; this tenant's limit is "
                                     f"{limits.max_prompt_tokens}", "prompt_too_long", {})
        wanted = num_prompt_tokens + max_tokens
        bucket = self._bucket(tenant)
        if bucket is not None and wanted > bucket.capacity:
            raise QuotaExceeded(400, f"prompt plus max_tokens is {wanted} tokens, more than this tenant's "
                                     f"tokens_per_minute ({int(bucket.capacity)})", "tokens_per_minute_exceeded", {})
        request_limit = self._request_limit(tenant)
        if request_limit is not None and self._in_flight[tenant.tenant_id] >= request_limit:
            raise QuotaExceeded(429, f"this tenant already has {request_limit} requests in flight, its limit",
                                "rate_limit_exceeded", self._headers(tenant, retry_after=1.0))
        if bucket is not None:
            if bucket.level < wanted:
                wait = bucket.seconds_until(wanted)
                raise QuotaExceeded(429, f"this tenant's tokens_per_minute is spent; {wanted} tokens are free "
                                         f"again in {wait:.1f} s", "rate_limit_exceeded",
                                    self._headers(tenant, retry_after=wait))
            bucket.level -= wanted
        self._in_flight[tenant.tenant_id] += 1
        return Admission(tenant, wanted, headers=self._headers(tenant))

    def check_fits(self, tenant: Tenant, num_requests: int) -> None:
        """QuotaExceeded (a 400) for a request of more engine requests (its choices, its prompts) than the
        tenant may ever have in flight: a 429 would send a client, or the batch runner, to retry it forever."""
        limit = self._request_limit(tenant)
        if limit is not None and num_requests > limit:
            raise QuotaExceeded(400, f"this request needs {num_requests} requests in flight at once (one per "
                                     f"prompt and choice); this tenant may have at most {limit}",
                                "too_many_generations", {})

    def release(self, admission: Admission, used_tokens: int) -> None:
        """The request ended: free its slot and refund the tokens it was charged but did not use."""
        if admission.released:
            return
        admission.released = True
        self._in_flight[admission.tenant.tenant_id] -= 1
        bucket = self._bucket(admission.tenant)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + max(0, admission.charged_tokens - used_tokens))

    @staticmethod
    def _request_limit(tenant: Tenant) -> int | None:
        limits = tenant.limits
        if limits.max_concurrent is None:
            return None if limits.max_queued is None else limits.max_queued
        return limits.max_concurrent + (limits.max_queued or 0)

    def _bucket(self, tenant: Tenant) -> TokenBucket | None:
        capacity = tenant.limits.tokens_per_minute
        if capacity is None:
            return None
        now = self._clock()
        bucket = self._buckets.get(tenant.tenant_id)
        if bucket is None:
            bucket = self._buckets[tenant.tenant_id] = TokenBucket(float(capacity), float(capacity), now)
        bucket.refill(now)
        return bucket

    def _headers(self, tenant: Tenant, retry_after: float | None = None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits this tenant has."""
        headers: dict[str, str] = {}
        request_limit = self._request_limit(tenant)
        if request_limit is not None:
            headers["x-ratelimit-limit-requests"] = str(request_limit)
            headers["x-ratelimit-remaining-requests"] = str(max(0, request_limit - self._in_flight[tenant.tenant_id]))
        bucket = self._bucket(tenant)
        if bucket is not None:
            headers["x-ratelimit-limit-tokens"] = str(int(bucket.capacity))
            headers["x-ratelimit-remaining-tokens"] = str(int(bucket.level))
            headers["x-ratelimit-reset-tokens"] = f"{bucket.seconds_until(bucket.capacity):.3f}s"
        if retry_after is not None:
            headers["retry-after"] = str(max(1, math.ceil(retry_after)))
        return headers
