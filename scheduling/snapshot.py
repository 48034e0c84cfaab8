"""What the world outside may know of the scheduler: one frozen snapshot, taken after every step.

`/stats`, `/metrics` and the dashboard read this and nothing else of the scheduler (vLLM's
`SchedulerStats` plays the same part), so no reader depends on the scheduler's internals or sees
them half-way through a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from contract.plan import CacheGeometry
from scheduling.request import PriorityClass


@dataclass(slots=True, frozen=True)
class ClassLoad:
    """Requests of one priority class, by state."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0


@dataclass(slots=True, frozen=True)
class BlockUse:
    used: int
    total: int

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


@dataclass(slots=True, frozen=True)
class TierStats:
    """One lower tier of the prefix cache (scheduling/cache_tiers.py)."""

    blocks: int
    capacity: int
    hits: int  # blocks found here and copied up (host) or read (disk) for a request
    writes: int
    evictions: int
    lost: int  # writes dropped or failed, reads that failed


@dataclass(slots=True, frozen=True)
class StepCostStats:
    """The step cost model and what step shaping did (see scheduling/step_shaper.py)."""

    predicted_s: float | None = None  # the last step's predicted time (None before the model is fitted)
    measured_s: float | None = None  # and its measured time
    median_error: float | None = None  # median |predicted - measured| / measured over recent steps
    coefficients: Mapping[str, float] | None = None  # seconds per unit of each term
    shaped_steps: int = 0
    batch_tokens_deferred: int = 0
    itl_target_missed_steps: int = 0  # interactive work alone predicted past its ITL target
    long_prompt_tokens_deferred: int = 0  # tenants' long prompts' tokens held to their turns


@dataclass(slots=True, frozen=True)
class SpeculationStats:
    """Speculative decoding's counts (vLLM's spec_decode counters), in all and per tenant."""

    num_drafts: int = 0  # decodes that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    by_tenant: Mapping[str, tuple[int, int, int]] = field(default_factory=lambda: MappingProxyType({}))  # drafts,
    # draft tokens, accepted tokens


@dataclass(slots=True, frozen=True)
class SchedulerSnapshot:
    step: int  # how many steps were scheduled before it
    by_class: Mapping[str, ClassLoad]  # class name -> its requests by state
    queued_by_tenant: Mapping[str, Mapping[str, int]]  # class name -> tenant -> waiting requests
    vtc: Mapping[str, Mapping[str, float]]  # class name -> tenant -> virtual token counter
    kv_blocks: BlockUse  # device blocks held by requests (free blocks that still cache a prefix are free)
    cpu_blocks: BlockUse  # the CPU swap pool
    cached_blocks: int  # device blocks that hold a findable prefix
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # by mode
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    bytes_per_block: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    step_cost: StepCostStats = field(default_factory=StepCostStats)
    tiers: Mapping[str, TierStats] = field(default_factory=lambda: MappingProxyType({}))  # "host", "disk" when set
    # Spearman's rho of predicted against actual output lengths, recent requests (scheduling/output_lengths.py)
    output_length_rank_correlation: float | None = None
    speculation: SpeculationStats | None = None  # None: speculative decoding is off

    @property
    def running(self) -> int:
        return sum(load.running for load in self.by_class.values())

    @property
    def waiting(self) -> int:
        return sum(load.waiting for load in self.by_class.values())

    @property
    def swapped(self) -> int:
        return sum(load.swapped for load in self.by_class.values())


def idle_snapshot(geometry: CacheGeometry) -> SchedulerSnapshot:
    """The snapshot of a scheduler that has run nothing: every class empty, every block free."""
    classes = [priority.value for priority in PriorityClass]
    return SchedulerSnapshot(
        step=0, by_class=MappingProxyType({name: ClassLoad() for name in classes}),
        queued_by_tenant=MappingProxyType({name: MappingProxyType({}) for name in classes}),
        vtc=MappingProxyType({name: MappingProxyType({}) for name in classes}),
        kv_blocks=BlockUse(0, geometry.num_device_blocks), cpu_blocks=BlockUse(0, geometry.num_cpu_blocks),
        cached_blocks=0, prefix_queried_tokens=0, prefix_hit_tokens=0, bytes_per_block=geometry.bytes_per_block)
