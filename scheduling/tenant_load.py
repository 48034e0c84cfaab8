"""Per-tenant and per-class request counts, kept up to date as requests arrive, start running, stop
and end, so that the admission rules read them in constant time instead of scanning the running list
or the queues for every waiting request at every step."""

from __future__ import annotations

from collections import Counter

from scheduling.request import PriorityClass, Request
from tenancy.tenants import TenantRegistry


class TenantLoad:
    def __init__(self, tenants: TenantRegistry) -> None:
        self._tenants = tenants
        self._max_concurrent = tenants.max_concurrent_limits()  # read for many waiting requests at every step
        self._unfinished: Counter[tuple[PriorityClass, str]] = Counter()  # per class and tenant
        self._unfinished_by_class: Counter[PriorityClass] = Counter()
        self._backlogged: dict[PriorityClass, set[str]] = {p: set() for p in PriorityClass}  # tenants, per class
        self._unfinished_by_tenant: Counter[str] = Counter()
        self._running_by_tenant: Counter[str] = Counter()
        self._running_by_class: Counter[PriorityClass] = Counter()
        self._running: Counter[tuple[PriorityClass, str]] = Counter()  # per class and tenant
        # Per class: the weights of the tenants with unfinished requests of that class or a higher one, summed.
        self._active_weight_from: dict[PriorityClass, float] = dict.fromkeys(PriorityClass, 0.0)

    # ---- changes ---------------------------------------------------------------------------

    def added(self, request: Request) -> list[str] | None:
        """Count a new unfinished request. If it makes its tenant newly backlogged in its class, the
        other tenants backlogged in that class (for the VTC lift); otherwise None."""
        key = (request.priority, request.tenant_id)
        newly_backlogged = self._unfinished[key] == 0
        others = list(self._backlogged[request.priority]) if newly_backlogged else None
        self._backlogged[request.priority].add(request.tenant_id)
        self._unfinished[key] += 1
        self._unfinished_by_class[request.priority] += 1
        self._count_tenant(request.tenant_id, +1)
        if newly_backlogged:
            self._weigh_active_tenants()
        return others

    def finished(self, request: Request) -> None:
        key = (request.priority, request.tenant_id)
        self._unfinished[key] -= 1
        self._unfinished_by_class[request.priority] -= 1
        self._count_tenant(request.tenant_id, -1)
        if self._unfinished[key] == 0:  # no longer backlogged in its class
            self._backlogged[request.priority].discard(request.tenant_id)
            self._weigh_active_tenants()

    def started_running(self, request: Request) -> None:
        self._running_by_tenant[request.tenant_id] += 1
        self._running_by_class[request.priority] += 1
        self._running[request.priority, request.tenant_id] += 1

    def stopped_running(self, request: Request) -> None:
        self._running_by_tenant[request.tenant_id] -= 1
        self._running_by_class[request.priority] -= 1
        self._running[request.priority, request.tenant_id] -= 1

    def _count_tenant(self, tenant_id: str, change: int) -> None:
        self._unfinished_by_tenant[tenant_id] += change
        if self._unfinished_by_tenant[tenant_id] == 0:
            del self._unfinished_by_tenant[tenant_id]

    def _weigh_active_tenants(self) -> None:
        """Recount the active weights per class; only when a tenant starts or stops being backlogged in a class."""
        best_rank: dict[str, int] = {}  # each tenant with unfinished requests: the rank of its highest class
        for (priority, tenant_id), count in self._unfinished.items():
            if count > 0:
                best_rank[tenant_id] = min(priority.rank, best_rank.get(tenant_id, priority.rank))
        self._active_weight_from = {
            p: sum(self._tenants.weight(t) for t, rank in best_rank.items() if rank <= p.rank) for p in PriorityClass}

    # ---- questions -------------------------------------------------------------------------

    def has_unfinished(self, priority: PriorityClass) -> bool:
        return self._unfinished_by_class[priority] > 0

    def backlogged(self, priority: PriorityClass) -> set[str]:
        """The tenants with an unfinished request of this class (a live view: do not change it)."""
        return self._backlogged[priority]

    def num_running(self, priority: PriorityClass) -> int:
        return self._running_by_class[priority]

    def active_weight_from(self, priority: PriorityClass) -> float:
        """The weights of the tenants with unfinished requests of this class or a higher one, summed (of
        the lowest class: of every tenant with an unfinished request)."""
        return self._active_weight_from[priority]

    @property
    def num_active_tenants(self) -> int:
        """Tenants with an unfinished request of either class."""
        return len(self._unfinished_by_tenant)

    def at_max_concurrent(self, tenant_id: str, num_reserved: int = 0) -> bool:
        """Whether the tenant runs as many requests as its max_concurrent allows, with `num_reserved` more
        counted as running. Only running requests count: a swapped or waiting one holds no room."""
        limit = self._max_concurrent.get(tenant_id)
        return limit is not None and self._running_by_tenant[tenant_id] + num_reserved >= limit

    def num_may_start(self, tenant_id: str, priority: PriorityClass) -> int | None:
        """How many more requests the tenant could run under its max_concurrent if its running requests
        of lower classes than `priority` gave way; None when it has no max_concurrent."""
        limit = self._max_concurrent.get(tenant_id)
        if limit is None:
            return None
        num_kept = sum(self._running[p, tenant_id] for p in PriorityClass if p.rank <= priority.rank)
        return max(0, limit - num_kept)

    def num_over_max_concurrent(self, tenant_id: str, num_more: int) -> int:
        """How many of the tenant's running requests must stop for `num_more` others to start within its
        max_concurrent (0 when it has none)."""
        limit = self._max_concurrent.get(tenant_id)
        return 0 if limit is None else max(0, self._running_by_tenant[tenant_id] + num_more - limit)
