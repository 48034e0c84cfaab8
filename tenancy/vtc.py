"""Weighted Virtual Token Counters ("Fairness in Serving Large Language Models", OSDI 2024).

Each tenant's counter grows by the service it received, divided by its weight: `w_p` per prompt
token computed and `w_q` per generated token. The backlogged tenant with the smallest counter is
served next; a tenant that becomes backlogged is lifted to the smallest counter among the
backlogged, so time spent idle is not banked as credit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ServiceWeights:
    prompt: float = 1.0  # w_p, per prompt token computed
    decode: float = 2.0  # w_q, per generated token
    cached_prompt: float = 0.1  # multiplier of w_p for prompt tokens served from the prefix cache
    cache_write: float = 1.25  # multiplier of w_p for prompt tokens written to blocks a breakpoint pins


class VirtualTokenCounter:
    def __init__(self, weights: ServiceWeights, tenant_weight: Callable[[str], float]) -> None:
        self.weights = weights
        self._tenant_weight = tenant_weight
        self._counters: dict[str, float] = {}
        # Unweighted service charged for work done here (not lifts, not service folded in from elsewhere).
        self._charged: dict[str, float] = {}

    def get(self, tenant_id: str) -> float:
        return self._counters.get(tenant_id, 0.0)

    def snapshot(self) -> dict[str, float]:
        return dict(self._counters)

    def service(self, num_prompt: int, num_decode: int, num_cached_prompt: int = 0, num_pinned_prompt: int = 0
                ) -> float:
        """Unweighted service of some work, in the VTC's cost units. num_pinned_prompt of the num_prompt
        tokens were written to pinned blocks: they cost cache_write times w_p instead of w_p."""
        w = self.weights
        return (w.prompt * num_prompt + w.decode * num_decode + w.prompt * w.cached_prompt * num_cached_prompt
                + w.prompt * (w.cache_write - 1.0) * num_pinned_prompt)

    def charge(self, tenant_id: str, num_prompt: int, num_decode: int, num_cached_prompt: int = 0,
               num_pinned_prompt: int = 0) -> None:
        cost = self.service(num_prompt, num_decode, num_cached_prompt, num_pinned_prompt)
        if cost:
            self._counters[tenant_id] = self.get(tenant_id) + cost / self._tenant_weight(tenant_id)
            self._charged[tenant_id] = self._charged.get(tenant_id, 0.0) + cost

    def charge_sampled(self, num_sampled_by_tenant: Mapping[str, int]) -> None:
        """`charge(tenant, 0, n)` for many tenants at once: the scheduler's decode charge of a step, one
        call instead of one per tenant."""
        decode, counters, charged, weight = self.weights.decode, self._counters, self._charged, self._tenant_weight
        for tenant_id, num_sampled in num_sampled_by_tenant.items():
            cost = decode * num_sampled
            if cost:
                counters[tenant_id] = counters.get(tenant_id, 0.0) + cost / weight(tenant_id)
                charged[tenant_id] = charged.get(tenant_id, 0.0) + cost

    def charged_service(self) -> dict[str, float]:
        """Per tenant, the unweighted service `charge` has added up since the start: exactly what this
        counter was charged for work done here, so a reader that takes differences of it (a cluster
        replica telling the others what it served) counts each charge once, when it is made."""
        return dict(self._charged)

    def lift(self, tenant_id: str, backlogged: Iterable[str]) -> None:
        """Called when tenant_id becomes backlogged: raise it to the smallest backlogged counter.
        With nobody else backlogged, raise it to the largest counter instead (how far service has got):
        otherwise a quiet moment would let a long-idle tenant keep its low counter and crowd out the
        tenants that arrive after it until it caught up."""
        others = [self.get(t) for t in backlogged if t != tenant_id]
        floor = min(others) if others else max(self._counters.values(), default=0.0)
        if floor > self.get(tenant_id):
            self._counters[tenant_id] = floor

    def charge_service(self, tenant_id: str, service: float) -> None:
        """Charge service the tenant received elsewhere (on another replica), in the unweighted units of
        `service()`: with every replica folding in the others' service, a tenant's counter counts all of
        it, so its share holds across replicas and not only within each."""
        if service:
            self._counters[tenant_id] = self.get(tenant_id) + service / self._tenant_weight(tenant_id)
