"""The one rule for whether a request that is not running may start in a step, and what it would take.

The scheduler asks it in two passes of every step, for the same requests:
- counting the room to make: waiting and swapped interactive requests, with the room running batch work
  could give way (`RoomCount`, scheduling/interactive_room.py);
- starting: swapped requests resuming and waiting requests admitted, with the room as it is, less what
  is owed to interactive requests counted but not started (`RoomNow`).
Both passes see the same limits in the same order, so a request counted for room is one the starting
pass can start once the room is made: counting one it cannot start would preempt batch work only to
resume it at the next step (see interactive_room.py). A new limit goes here, once.

A waiting request held back passes its tenant over for the rest of the pass, since a later request of
the same tenant would jump its line; a swapped one holds no place in a line, so only it waits. The
step's own caps (sequences, tokens, the shaped time budget) and the blocks themselves are the caller's:
counting makes blocks by preemption, starting takes what is free.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from scheduling.block_manager import KVBlockManager
from scheduling.interactive_room import NOTHING_OWED, RoomOwed, waits_for_room
from scheduling.lora_residency import LoraResidency
from scheduling.request import Request, RequestStatus
from scheduling.tenant_limits import TenantLimits
from scheduling.tenant_load import TenantLoad


class Hold(Enum):
    TENANT = "tenant"  # the tenant is passed over for the rest of the pass
    REQUEST = "request"  # only this (swapped) request waits


@dataclass(slots=True, frozen=True)
class Verdict:
    hold: Hold | None  # None: it may start
    num_new: int = 0  # the tokens it would compute in the step
    num_blocks: int = 0  # the device blocks it would need for them (a swapped request's own come back too)


class Room(Protocol):
    def has_room(self, request: Request) -> bool:
        """A LoRA slot for its adapter and room under its tenant's max_concurrent."""


class RoomNow:
    """The room as it is, less what is owed to interactive requests room was made for."""

    def __init__(self, lora: LoraResidency, load: TenantLoad, owed: RoomOwed = NOTHING_OWED) -> None:
        self._lora = lora
        self._load = load
        self._owed = owed

    def has_room(self, request: Request) -> bool:
        return not waits_for_room(request, self._lora, self._load, self._owed)


class AdmissionRule:
    def __init__(self, limits: TenantLimits, blocks: KVBlockManager) -> None:
        self._limits = limits
        self._blocks = blocks

    def verdict(self, request: Request, tokens_left: int, room: Room, passed_over: Container[str]) -> Verdict:
        """Whether the request may start with at most `tokens_left` tokens beside what the pass started
        (or counted) before it, and if so how many tokens and device blocks it would take."""
        num_new = min(request.num_uncomputed_tokens, tokens_left)
        waiting = request.status is RequestStatus.WAITING
        if waiting and (request.tenant_id in passed_over or self._limits.over_kv_share(request, num_new)):
            return Verdict(Hold.TENANT)
        if not room.has_room(request):
            return Verdict(Hold.TENANT if waiting else Hold.REQUEST)
        return Verdict(None, num_new, self._blocks_to_start(request, num_new))

    def _blocks_to_start(self, request: Request, num_new: int) -> int:
        if request.status is RequestStatus.SWAPPED:  # all its blocks come back to the device
            return self._blocks.blocks_to_swap_in(request, num_new)
        return self._blocks.blocks_needed(request, num_new)
