"""The KV share rule: whether a tenant's waiting request would take it past its share of device blocks.

Asked by the admission rule (scheduling/admission.py) for the waiting requests a step looks at; it
reads the counts of `TenantLoad`, the blocks each tenant holds and the waiting queues, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from scheduling.block_manager import KVBlockManager
from scheduling.queue import RequestQueue
from scheduling.request import PriorityClass, Request
from scheduling.tenant_load import TenantLoad
from tenancy.tenants import TenantRegistry


class TenantLimits:
    def __init__(self, tenants: TenantRegistry, load: TenantLoad, blocks: KVBlockManager,
                 waiting: Mapping[PriorityClass, RequestQueue], num_device_blocks: int, kv_share_limit: bool) -> None:
        self._tenants = tenants
        self._load = load
        self._blocks = blocks
        self._waiting = waiting
        self._num_device_blocks = num_device_blocks
        self._kv_share_limit = kv_share_limit
        # What the KV share rule of a request of each class sees: that class and those above it.
        self._classes_seen = {c: tuple(p for p in PriorityClass if p.rank <= c.rank) for c in PriorityClass}

    def over_kv_share(self, request: Request, num_new: int) -> bool:
        """The KV share rule: while another tenant has a request waiting, a tenant is not admitted
        past its weighted share of device blocks, total * w / (sum of w of tenants with unfinished
        requests). Running requests are not cut back; the rule acts at admission. A tenant holding no
        blocks may always start one request: one larger than the share would otherwise wait for as
        long as another tenant kept a request waiting. Another tenant's waiting request counts only
        if it could be admitted now (its tenant is below max_concurrent); else memory would sit idle.

        The rule sees the request's class and those above it, never those below: the blocks held, the
        tenants in the share and the tenants waiting are all of those classes. Lower-class work gives
        way to the request anyway (it is preempted for it, or runs after it), so it must not hold it
        back: an interactive request held back by its tenant's batch blocks waits on batch work, which
        waits on interactive work. Batch, the lowest class, sees every class."""
        if not self._kv_share_limit or self._load.num_active_tenants < 2:
            return False
        classes = self._classes_seen[request.priority]
        held = sum(self._blocks.device_blocks_held_by(request.tenant_id, p) for p in classes)
        if held == 0:
            return False
        share = (self._num_device_blocks * self._tenants.weight(request.tenant_id)
                 / self._load.active_weight_from(request.priority))
        if held + self._blocks.blocks_needed(request, num_new) <= share:
            return False
        return any(t != request.tenant_id and not self._load.at_max_concurrent(t)
                   for t in self._tenants_waiting(classes))

    def _tenants_waiting(self, classes: tuple[PriorityClass, ...]) -> Iterator[str]:
        """Each tenant with a waiting request of these classes (once per class), lazily."""
        for priority in classes:
            yield from self._waiting[priority].tenants()
