"""Which LoRA adapter sits in which of the runner's `max_loras` device slots. Torch-free.

A running request pins its adapter's slot; a slot nobody pins stays resident (a later request of
that adapter needs no load) until a request of another adapter needs a slot and none is free: the
least recently used unpinned slot is then reused. The allocator reports, the policy decides:
`can_acquire` says whether a request could get a slot now, and a request that cannot waits in its
queue, as one waits for KV blocks, while the others run (an interactive request does not wait on batch
work: the batch requests pinning a slot give way, see scheduling/interactive_room.py).

What must stay true: a pinned slot is never reused, so a step never overwrites the adapter of a
sequence it runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from contract.plan import BASE_MODEL_SLOT, LoraRef


@dataclass(slots=True, frozen=True)
class SlotGrant:
    """A slot handed to a request: where its adapter is, and whether the runner must load it there first."""

    slot: int
    needs_load: bool


class LoraResidency:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._adapter_in: list[LoraRef | None] = [None] * num_slots
        self._slot_of: dict[LoraRef, int] = {}
        self._pins = [0] * num_slots  # running requests using each slot
        self._unpinned: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))  # least recently used first

    # ---- questions (change nothing) --------------------------------------------------------

    def slot_of(self, adapter: LoraRef) -> int | None:
        return self._slot_of.get(adapter)

    def can_acquire(self, adapter: LoraRef | None, keep_unpinned: int = 0) -> bool:
        """Whether a request of this adapter (None: the base model) could run now and leave at least
        `keep_unpinned` slots unpinned (held for others): sharing a pinned slot takes none."""
        if adapter is None or self.is_pinned(adapter):
            return True
        return len(self._unpinned) > keep_unpinned

    def is_pinned(self, adapter: LoraRef) -> bool:
        """Whether the adapter sits in a slot a running request pins: another request of it shares that slot."""
        slot = self._slot_of.get(adapter)
        return slot is not None and self._pins[slot] > 0

    @property
    def num_unpinned(self) -> int:
        return len(self._unpinned)

    def pinned_slots(self) -> dict[int, int]:
        """Each slot running requests pin, and how many of them."""
        return {slot: pins for slot, pins in enumerate(self._pins) if pins}

    def resident(self) -> list[LoraRef | None]:
        """Each slot's adapter, or None for an empty slot."""
        return list(self._adapter_in)

    def num_pins(self, slot: int) -> int:
        return self._pins[slot]

    # ---- changes ---------------------------------------------------------------------------

    def acquire(self, adapter: LoraRef | None) -> SlotGrant | None:
        """Pin a slot holding the adapter for one running request, loading it into the least recently used
        unpinned slot if it is not resident. None, and nothing changed, when every slot is pinned."""
        if adapter is None:
            return SlotGrant(BASE_MODEL_SLOT, needs_load=False)
        slot = self._slot_of.get(adapter)
        needs_load = slot is None
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._place(slot, adapter)
        self._pins[slot] += 1
        self._unpinned.pop(slot, None)
        return SlotGrant(slot, needs_load)

    def release(self, slot: int) -> None:
        """A request that pinned the slot stopped running (finished, or preempted)."""
        if slot == BASE_MODEL_SLOT:
            return
        if self._pins[slot] <= 0:
            raise AssertionError(f"LoRA slot {slot} released more often than acquired")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._unpinned[slot] = None  # now the most recently used

    def empty(self, slot: int) -> LoraRef | None:
        """The runner could not load the slot's adapter: the slot holds nothing now (its pins go as the
        requests that hold them end). Returns the adapter it was meant to hold."""
        adapter = self._adapter_in[slot]
        if adapter is not None:
            del self._slot_of[adapter]
            self._adapter_in[slot] = None
        return adapter

    def _free_slot(self) -> int | None:
        """An empty unpinned slot, else the least recently used unpinned one."""
        empty = next((s for s in self._unpinned if self._adapter_in[s] is None), None)
        return empty if empty is not None else next(iter(self._unpinned), None)

    def _place(self, slot: int, adapter: LoraRef) -> None:
        evicted = self._adapter_in[slot]
        if evicted is not None:
            del self._slot_of[evicted]
        self._adapter_in[slot] = adapter
        self._slot_of[adapter] = slot
