"""The room besides KV blocks and sequence slots that running batch requests give up for waiting
interactive requests: a LoRA slot, and room under their tenant's own max_concurrent. Torch-free.

Interactive requests never wait on batch work (DESIGN.md, Scheduling). Two limits would otherwise make
them: every LoRA slot pinned by running batch requests of other adapters (while more batch requests of
those adapters keep being admitted, for as long as they keep coming), and a tenant's max_concurrent
taken by its own batch requests. `RoomCount` counts, request by request in the order a step starts
them, whether that room can be had for each waiting interactive request, and which running batch
requests must give way for it; the scheduler preempts them. LoraResidency and TenantLoad report; the
choices are made here.

What must stay true:
- room is never taken from interactive work: a slot an interactive request pins is never freed, and a
  tenant's running interactive requests never give way for its max_concurrent;
- for a tenant's max_concurrent only its own batch requests give way, never another tenant's;
- a request is counted only if its room can be made: batch work preempted for a request that cannot
  start would resume at the next step and be preempted again;
- the room made stays the interactive request's until it starts (`RoomOwed`): batch work that took it
  back would be preempted again at the next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from contract.plan import BASE_MODEL_SLOT, LoraRef
from scheduling.lora_residency import LoraResidency
from scheduling.preemption import victims_in_order
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.tenant_load import TenantLoad

BATCH, INTERACTIVE = PriorityClass.BATCH, PriorityClass.INTERACTIVE
STILL_WAITING = (RequestStatus.WAITING, RequestStatus.SWAPPED)


class RoomCount:
    """The LoRA slots and the max_concurrent room of the waiting interactive requests a step makes room
    for, counted as they are added; the batch requests that give way are asked for once all are counted."""

    def __init__(self, lora: LoraResidency, load: TenantLoad, running: list[Request]) -> None:
        self._lora = lora
        self._load = load
        self._running = running  # the scheduler's list: victims are chosen from what still runs
        self._adapters: set[LoraRef] = set()  # of the requests counted
        self._num_of_tenant: Counter[str] = Counter()  # requests counted, per tenant
        self._batch_only_slots: dict[int, list[Request]] | None = None  # found when first needed

    def has_room(self, request: Request) -> bool:
        """Whether the request could start beside those counted before it once running batch requests give
        way: a slot for its adapter, and room under its tenant's max_concurrent."""
        return self._has_slot(request.adapter) and self._has_tenant_room(request.tenant_id)

    def add(self, request: Request) -> None:
        if request.adapter is not None:
            self._adapters.add(request.adapter)
        self._num_of_tenant[request.tenant_id] += 1

    def lora_victims(self) -> list[Request]:
        """The running batch requests pinning the slots the counted adapters need beyond the unpinned ones:
        slots pinned by batch requests alone, those with the fewest first. Asked before any preemption."""
        num_short = self._num_needing_slots(self._adapters) - self._lora.num_unpinned
        if num_short <= 0:
            return []
        # Fewest victims first; between equals, the slot whose newest request is newest (choose_victim's order).
        freed = sorted(self._freeable_slots(self._adapters).values(),
                       key=lambda pinners: (len(pinners), -max(r.arrival_time for r in pinners)))[:num_short]
        return [request for pinners in freed for request in pinners]

    def concurrency_victims(self) -> list[Request]:
        """Each tenant's own running batch requests, newest first, as many as its counted interactive
        requests need under its max_concurrent. Asked once the LoRA victims are preempted: those count."""
        victims: list[Request] = []
        for tenant_id, num_counted in self._num_of_tenant.items():
            num_over = self._load.num_over_max_concurrent(tenant_id, num_counted)
            if num_over:
                own_batch = (r for r in self._running if r.tenant_id == tenant_id and r.priority is BATCH)
                victims += victims_in_order(own_batch)[:num_over]
        return victims

    def _has_slot(self, adapter: LoraRef | None) -> bool:
        if adapter is None or adapter in self._adapters:
            return True
        adapters = self._adapters | {adapter}
        num_needing = self._num_needing_slots(adapters)
        if num_needing <= self._lora.num_unpinned:
            return True  # no slot need be freed: the common case, without a look at the running requests
        # It may share a slot that could otherwise be freed for another: that one is then not freeable.
        return num_needing <= self._lora.num_unpinned + len(self._freeable_slots(adapters))

    def _num_needing_slots(self, adapters: Iterable[LoraRef]) -> int:
        """The adapters that take an unpinned slot: those not in a pinned one (they share it)."""
        return sum(not self._lora.is_pinned(adapter) for adapter in adapters)

    def _freeable_slots(self, adapters: set[LoraRef]) -> dict[int, list[Request]]:
        """The slots running batch requests alone pin, and those requests; but for the slots holding one of
        `adapters`, whose interactive requests share them."""
        if self._batch_only_slots is None:
            self._batch_only_slots = self._slots_pinned_by_batch_alone()
        resident = self._lora.resident()
        return {slot: pinners for slot, pinners in self._batch_only_slots.items() if resident[slot] not in adapters}

    def _slots_pinned_by_batch_alone(self) -> dict[int, list[Request]]:
        pinners: dict[int, list[Request]] = {}
        for request in self._running:
            if request.priority is BATCH and request.lora_slot != BASE_MODEL_SLOT:
                pinners.setdefault(request.lora_slot, []).append(request)
        num_pins = self._lora.pinned_slots()
        return {slot: requests for slot, requests in pinners.items() if len(requests) == num_pins[slot]}

    def _has_tenant_room(self, tenant_id: str) -> bool:
        num_may_start = self._load.num_may_start(tenant_id, INTERACTIVE)
        return num_may_start is None or self._num_of_tenant[tenant_id] < num_may_start


@dataclass(slots=True, frozen=True)
class RoomOwed:
    """What a lower class's request starting in a step must leave to the interactive requests room was
    counted for and that still wait (for a disk read, say): their adapters' slots, their tenants' room."""

    adapters: frozenset[LoraRef] = frozenset()
    num_of_tenant: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


NOTHING_OWED = RoomOwed()


def room_owed(counted: Iterable[Request]) -> RoomOwed:
    """What the counted interactive requests that have not started are owed."""
    waiting = [r for r in counted if r.status in STILL_WAITING]
    if not waiting:
        return NOTHING_OWED
    return RoomOwed(frozenset(r.adapter for r in waiting if r.adapter is not None),
                    MappingProxyType(Counter(r.tenant_id for r in waiting)))


def waits_for_room(request: Request, lora: LoraResidency, load: TenantLoad, owed: RoomOwed = NOTHING_OWED) -> bool:
    """Whether the request must wait for a LoRA slot or for room under its tenant's max_concurrent, the
    room `owed` to waiting interactive requests left to them. A request of an adapter they wait for may
    take its slot: they share it then."""
    adapter = request.adapter
    keep_unpinned = 0 if adapter in owed.adapters else sum(not lora.is_pinned(a) for a in owed.adapters)
    return (not lora.can_acquire(adapter, keep_unpinned)
            or load.at_max_concurrent(request.tenant_id, owed.num_of_tenant.get(request.tenant_id, 0)))
