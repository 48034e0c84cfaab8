"""The order inside one tenant's waiting line: which of its requests goes first. Across tenants the
weighted fair queue (VTC, scheduling/queue.py) decides, unchanged; this only picks within a tenant.

- `fcfs`: first come, first served.
- `hrrn`: highest response ratio next, (wait + predicted work) / predicted work: short requests go first,
  and a long one's ratio grows as it waits. Below capacity that is enough; past it the short requests'
  ratios grow too, and a long one can wait on and on.
- `srpt`: shortest predicted work first.
- `lpm`: the longest prefix already in the device cache first (its prompt is mostly computed, and its
  blocks are shared before they are evicted). The cache is salted per tenant, and the line is one
  tenant's, so a match never crosses tenants.
Under each of the three, a request goes first (the oldest first) once it is overdue: passed over for
`queue_fcfs_stretch` times what FCFS would have made it wait, in the line's own work
(scheduling/fcfs_bound.py), or for `aging_s` seconds. These bound how long a long request can be passed
over. Every order, deadlines included, weighs the line's oldest MAX_WEIGHED requests only.
`fairlane bench queue-order` measures them against FCFS on a mixed-length trace past capacity; its
table chose the server's default (config/settings.py).

Predicted work, in tokens: the prompt tokens still to compute plus the predicted output
(scheduling/output_lengths.py). Whatever the order:
- a request carrying a TTFT deadline goes before those without, least slack first (the deadline less
  the time to its predicted first token);
- a preempted request put back (`prepend`) goes before all the others: order alone preempts nothing,
  and a request that had started keeps its place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from scheduling.request import Request

QueueOrderName = Literal["fcfs", "hrrn", "srpt", "lpm"]
QUEUE_ORDERS: tuple[QueueOrderName, ...] = ("fcfs", "hrrn", "srpt", "lpm")
# The oldest requests of a line an order weighs: a pick looks at no more, so admitting from a line of
# thousands (one tenant's flood) costs what admitting from a short one does.
MAX_WEIGHED = 128


@dataclass(slots=True)
class OrderContext:
    """What an order reads besides the requests: the time, the predicted work, the cached prefix."""

    clock: Callable[[], float]
    predicted_work: Callable[[Request], float]  # tokens
    cached_prefix_tokens: Callable[[Request], int]
    token_s: Callable[[], float]  # seconds per token of work, to weigh waiting against work (HRRN, slack)
    aging_s: float = 30.0
    is_overdue: Callable[[Request], bool] | None = None  # passed over long enough (fcfs_bound.py); None: off


class QueueOrder:
    def __init__(self, name: QueueOrderName, context: OrderContext) -> None:
        if name not in QUEUE_ORDERS:
            raise ValueError(f"unknown queue order '{name}' (choose from {', '.join(QUEUE_ORDERS)})")
        self.name = name
        self.context = context

    def first(self, requests: list[Request]) -> Request:
        """The request of a non-empty line (in arrival order) to go first."""
        if len(requests) == 1:
            return requests[0]
        weighed = requests[:MAX_WEIGHED]  # a long line: its oldest, so a pick costs O(1) however long it grows
        with_deadline = [r for r in weighed if r.ttft_deadline is not None]
        if with_deadline:
            return min(with_deadline, key=self._slack)
        if self.name == "fcfs":
            return requests[0]
        now = self.context.clock()
        if now - requests[0].arrival_time >= self.context.aging_s:
            return requests[0]  # aged: the oldest goes first
        is_overdue = self.context.is_overdue
        overdue = None if is_overdue is None else next((r for r in weighed if is_overdue(r)), None)
        if overdue is not None:
            return overdue  # the oldest of those passed over as far as they may be
        if self.name == "hrrn":
            token_s, work = self.context.token_s(), self.context.predicted_work
            return max(weighed, key=lambda r: (now - r.arrival_time) / (max(work(r), 1.0) * token_s))
        if self.name == "srpt":
            return min(weighed, key=self.context.predicted_work)
        return max(weighed, key=self.context.cached_prefix_tokens)  # max keeps the earliest of equals

    def ranked(self, requests: list[Request]) -> list[Request]:
        """The requests (in arrival order) as `first` would pick them one after another: those with a
        TTFT deadline by slack, then the overdue oldest first, then by the order (highest response ratio,
        or least predicted work). FCFS and LPM keep the given order (a running prompt's prefix is cached
        already)."""
        if self.name in ("fcfs", "lpm") or len(requests) < 2:
            return requests
        now, token_s, work = self.context.clock(), self.context.token_s(), self.context.predicted_work
        is_overdue = self.context.is_overdue

        def rank(r: Request) -> tuple[int, float]:
            if r.ttft_deadline is not None:
                return 0, self._slack(r)
            if now - r.arrival_time >= self.context.aging_s or (is_overdue is not None and is_overdue(r)):
                return 1, r.arrival_time
            if self.name == "hrrn":
                return 2, -(now - r.arrival_time) / (max(work(r), 1.0) * token_s)
            return 2, work(r)

        return sorted(requests, key=rank)

    def _slack(self, request: Request) -> float:
        assert request.ttft_deadline is not None
        to_first_token_s = (request.num_prompt_tokens - request.num_computed_tokens) * self.context.token_s()
        return request.ttft_deadline - self.context.clock() - to_first_token_s


class TenantLine:
    """One tenant's waiting requests: those put back after a preemption first, in the order they were
    put back, then the rest as the queue order picks."""

    def __init__(self, order: QueueOrder | None = None) -> None:
        self._order = order  # None: first come, first served
        self._put_back: deque[Request] = deque()
        self._arrived: list[Request] = []  # in arrival order

    def append(self, request: Request) -> None:
        self._arrived.append(request)

    def appendleft(self, request: Request) -> None:
        self._put_back.appendleft(request)

    def first(self) -> Request:
        if self._put_back:
            return self._put_back[0]
        return self._arrived[0] if self._order is None else self._order.first(self._arrived)

    def remove(self, request: Request) -> None:
        if request in self._put_back:
            self._put_back.remove(request)
        else:
            self._arrived.remove(request)

    def __len__(self) -> int:
        return len(self._put_back) + len(self._arrived)

    def __iter__(self) -> Iterator[Request]:
        """The line, the first request first (the others in arrival order)."""
        if self._put_back:
            yield from self._put_back
            yield from self._arrived
            return
        if not self._arrived:
            return
        first = self.first()
        yield first
        yield from (r for r in self._arrived if r is not first)
