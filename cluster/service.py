"""Fairness across replicas: each replica measures the service it gives per tenant, the board adds
it up, and each replica folds the others' service into its own VTC counters.

A replica alone sees only its own share of a tenant's traffic: a tenant that floods two replicas
would get half of each, twice its share. With the others' service folded in, a tenant's counter on
every replica counts all the service it got, so each replica's fair queue serves it accordingly.
Ray-free: the board is a plain class here, made a Ray actor by the launcher.
"""

from __future__ import annotations

import time
from collections import defaultdict

from cluster.wire import ReplicaReport, ServiceByTenant
from scheduling.scheduler import Scheduler


class ServiceMeter:
    """The service this replica gave each tenant, read from its scheduler's VTC counters: exactly what
    `charge` added to them for work done here (prompt tokens as each chunk is computed, cached prompt
    tokens at admission, each sampled token), never the lifts nor the others' service folded in.
    `take()` hands over what was charged since the last call, so the board hears of a long prompt's
    prefill as it happens and not only when its first token comes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        # Per class, per tenant: the counters' charged service as of the last take (less any given back).
        self._reported: dict[str, dict[str, float]] = {}

    def take(self) -> ServiceByTenant:
        taken: ServiceByTenant = {}
        for priority, vtc in self._scheduler.vtc.items():
            charged = vtc.charged_service()
            reported = self._reported.get(priority.value, {})
            new = {tenant_id: amount - reported.get(tenant_id, 0.0) for tenant_id, amount in charged.items()
                   if amount > reported.get(tenant_id, 0.0)}
            if new:
                taken[priority.value] = new
            self._reported[priority.value] = charged
        return taken

    def give_back(self, service: ServiceByTenant) -> None:
        """Service taken for a report that never reached the board: it goes out with the next one."""
        for name, tenants in service.items():
            reported = self._reported[name]
            for tenant_id, amount in tenants.items():
                reported[tenant_id] -= amount


class ServiceLedger:
    """Every replica's total service per tenant, and how much of the others' each replica has folded
    in: an exchange hands a replica exactly what it has not seen yet, so nothing counts twice."""

    def __init__(self) -> None:
        self._given: dict[str, defaultdict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
        self._folded: dict[str, defaultdict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))

    def exchange(self, replica_id: str, service: ServiceByTenant) -> ServiceByTenant:
        given = self._given[replica_id]
        for name, tenants in service.items():
            for tenant_id, amount in tenants.items():
                given[(name, tenant_id)] += amount
        others: defaultdict[tuple[str, str], float] = defaultdict(float)
        for other_id, other_given in self._given.items():
            if other_id != replica_id:
                for key, amount in other_given.items():
                    others[key] += amount
        folded = self._folded[replica_id]
        unseen: dict[str, dict[str, float]] = defaultdict(dict)
        for (name, tenant_id), amount in others.items():
            delta = amount - folded[(name, tenant_id)]
            if delta > 0:
                unseen[name][tenant_id] = delta
                folded[(name, tenant_id)] = amount
        return dict(unseen)


class ClusterBoard:
    """The one shared place (a Ray actor): the service ledger, and each replica's latest report for
    the ingress's /health and /stats. Its methods are short and synchronous: an actor runs them one
    at a time, so the ledger needs no lock."""

    def __init__(self) -> None:
        self._ledger = ServiceLedger()
        self._reports: dict[str, ReplicaReport] = {}

    def exchange(self, report: ReplicaReport) -> ServiceByTenant:
        """Record a replica's report; answer the others' service it has not folded in yet."""
        self._reports[report.replica_id] = report
        return self._ledger.exchange(report.replica_id, report.service)

    def reports(self, max_age_s: float) -> list[ReplicaReport]:
        """The latest report of each replica heard from within max_age_s (a dead one stops reporting)."""
        now = time.time()
        return [r for r in self._reports.values() if now - r.sent_at <= max_age_s]
