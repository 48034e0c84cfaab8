"""Victim choice for preemption, and the record of each preemption.

The rule: a lower class gives way before a higher one (batch before interactive), and within a
class the newest arrival gives way first (it has the least work to lose and waited the least).
Interactive requests are therefore never preempted while a batch request runs, and never for one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduling.request import PriorityClass, Request, RequestId


class PreemptionMode(enum.Enum):
    SWAP = "swap"  # copy the KV blocks to the CPU pool; resume exactly where it stopped
    RECOMPUTE = "recompute"  # drop the KV blocks; on resume, prefill prompt + output so far


@dataclass(slots=True, frozen=True)
class PreemptionEvent:
    """One preemption, kept for /stats and for tests that check who gave way to whom."""

    step: int
    victim_id: RequestId
    victim_class: PriorityClass
    mode: PreemptionMode
    num_blocks: int
    for_class: PriorityClass  # the class of the request that needed the room


def victim_order_key(request: Request) -> tuple[int, float]:
    """Larger gives way first: lowest class, then newest."""
    return (request.priority.rank, request.arrival_time)


def choose_victim(candidates: Sequence[Request], for_class: PriorityClass) -> Request | None:
    """The request to preempt so one of `for_class` can run; never one of a higher class."""
    allowed = [r for r in candidates if r.priority.rank >= for_class.rank]
    return max(allowed, key=victim_order_key, default=None)


def victims_in_order(candidates: Iterable[Request]) -> list[Request]:
    """Batch requests in the order repeated `choose_victim` calls would take them (the first of equals
    first, as `max` picks): one sort for a burst of preemptions instead of a scan for each."""
    return sorted(candidates, key=victim_order_key, reverse=True)
