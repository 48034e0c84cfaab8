"""Waiting-queue order behind a small protocol, with a factory: FCFS, or per-tenant weighted fair (VTC).

`peek(exclude)` returns the next request whose tenant is not excluded, so the scheduler can pass
over a tenant that is at its limits without losing the order of the others.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Container, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

from scheduling.queue_order import QueueOrder, TenantLine
from scheduling.request import Request
from tenancy.vtc import VirtualTokenCounter


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...

    def prepend(self, request: Request) -> None:
        """Put a preempted request back at the head of its tenant's line."""

    def peek(self, exclude: Container[str] = ()) -> Request | None: ...

    def passing_over(self) -> AbstractContextManager[None]:
        """A pass of peeks in which excluded tenants stay excluded (see VTCQueue.passing_over)."""

    def remove(self, request: Request) -> None: ...

    def queued_by_tenant(self) -> dict[str, int]:
        """Waiting requests per tenant with any, without walking the queue."""

    def tenants(self) -> Iterable[str]:
        """Each tenant with a waiting request, once (a live view: do not change the queue while reading it)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served, across tenants."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()
        self._by_tenant: Counter[str] = Counter()

    def add(self, request: Request) -> None:
        self._requests.append(request)
        self._by_tenant[request.tenant_id] += 1

    def prepend(self, request: Request) -> None:
        self._requests.appendleft(request)
        self._by_tenant[request.tenant_id] += 1

    def peek(self, exclude: Container[str] = ()) -> Request | None:
        return next((r for r in self._requests if r.tenant_id not in exclude), None)

    def passing_over(self) -> AbstractContextManager[None]:
        return nullcontext()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        self._by_tenant[request.tenant_id] -= 1
        if not self._by_tenant[request.tenant_id]:
            del self._by_tenant[request.tenant_id]

    def queued_by_tenant(self) -> dict[str, int]:
        return dict(self._by_tenant)

    def tenants(self) -> Iterable[str]:
        return self._by_tenant.keys()

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class VTCQueue:
    """Across tenants, the smallest virtual token counter goes first; within a tenant, its line's order
    (scheduling/queue_order.py: first come, first served unless another is chosen).

    A lazy min-heap of (counter, tiebreak, tenant): counters only grow, so an entry whose counter is
    out of date is refreshed when it reaches the top. Selection is O(log tenants) amortized. A tenant
    has at most one entry: an emptied line leaves its entry behind, and a refill reuses it rather than
    pushing another (entries would otherwise pile up, one per refill, and every peek would walk them).
    """

    def __init__(self, counter: VirtualTokenCounter, order: QueueOrder | None = None) -> None:
        self._counter = counter
        self._order = order
        self._per_tenant: dict[str, TenantLine] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        self._size = 0
        self._in_heap: set[str] = set()  # tenants with an entry in the heap
        # Within `passing_over`: the entries of excluded tenants, out of the heap until the pass ends.
        self._set_aside: list[tuple[float, int, str]] | None = None

    def _push(self, tenant_id: str) -> None:
        heapq.heappush(self._heap, (self._counter.get(tenant_id), next(self._tiebreak), tenant_id))
        self._in_heap.add(tenant_id)

    def _line(self, request: Request) -> TenantLine:
        line = self._per_tenant.get(request.tenant_id)
        if line is None:
            line = self._per_tenant[request.tenant_id] = TenantLine(self._order)
            if request.tenant_id not in self._in_heap:
                self._push(request.tenant_id)
        return line

    def add(self, request: Request) -> None:
        self._line(request).append(request)
        self._size += 1

    def prepend(self, request: Request) -> None:
        self._line(request).appendleft(request)
        self._size += 1

    @contextmanager
    def passing_over(self) -> Iterator[None]:
        """A pass of peeks whose excluded tenants only grow (the scheduler's admission loop): an excluded
        tenant's entry is set aside once instead of popped and pushed back at every peek, which would cost
        the pass O(excluded^2 log tenants). The entries return to the heap when the pass ends."""
        self._set_aside = []
        try:
            yield
        finally:
            for entry in self._set_aside:
                heapq.heappush(self._heap, entry)
            self._set_aside = None

    def peek(self, exclude: Container[str] = ()) -> Request | None:
        passed_over: list[tuple[float, int, str]] = [] if self._set_aside is None else self._set_aside
        found: Request | None = None
        while self._heap:
            counter, _, tenant_id = self._heap[0]
            line = self._per_tenant.get(tenant_id)
            if not line:
                heapq.heappop(self._heap)  # the tenant's line emptied since
                self._in_heap.discard(tenant_id)
            elif counter != self._counter.get(tenant_id):
                heapq.heapreplace(self._heap, (self._counter.get(tenant_id), next(self._tiebreak), tenant_id))
            elif tenant_id in exclude:
                passed_over.append(heapq.heappop(self._heap))
            else:
                found = line.first()
                break
        if self._set_aside is None:
            for entry in passed_over:
                heapq.heappush(self._heap, entry)
        return found

    def remove(self, request: Request) -> None:
        line = self._per_tenant[request.tenant_id]
        line.remove(request)
        self._size -= 1
        if not line:
            del self._per_tenant[request.tenant_id]

    def queued_by_tenant(self) -> dict[str, int]:
        return {t: len(line) for t, line in self._per_tenant.items()}

    def tenants(self) -> Iterable[str]:
        return self._per_tenant.keys()  # a tenant's line is dropped when it empties

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._per_tenant.values())


def create_request_queue(policy: str, counter: VirtualTokenCounter, order: QueueOrder | None = None
                         ) -> RequestQueue:
    """`order` picks within each tenant's line under vtc (None: first come, first served)."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "vtc":
        return VTCQueue(counter, order)
    raise ValueError(f"unknown queue policy '{policy}' (fcfs or vtc)")
