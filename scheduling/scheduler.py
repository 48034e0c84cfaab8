"""The scheduler: at every step, who runs, how many tokens each, and with which blocks.

Counters, not phases: each request's `num_computed_tokens` catches up to `num_tokens`. A step is
built in phases, each within one token budget and one sequence cap:
  1. make room: if interactive requests wait for blocks, sequence slots, LoRA slots or their tenant's
     max_concurrent, preempt running batch requests;
  2. running requests: interactive before batch, decodes before prefill chunks;
  3. swapped-in and newly admitted requests: interactive first, batch only when no interactive waits.
  4. speculative decoding, when configured: proposed tokens for the decodes, from what the step left
     (scheduling/speculation.py); rejected ones' blocks come back in `update`.
Phases 1 and 3 ask one admission rule (scheduling/admission.py) whether a request may start.
While interactive requests are active, batch work also has to fit the step's time budget (step
shaping, scheduling/step_shaper.py); what does not fit keeps its blocks and waits for the next step.
Only this class changes a request's status.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Container, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from contract.plan import BASE_MODEL_SLOT, CacheGeometry, ScheduledSequence, StepPlan, StepResult, TokenLogprobs
from scheduling.admission import AdmissionRule, Hold, RoomNow, Verdict
from scheduling.block_manager import KVBlockManager
from scheduling.cache_pins import CachePins
from scheduling.cache_tiers import LowerTiers
from scheduling.calibration import LONE_DECODE, SHAPES, calibration_plans
from scheduling.fcfs_bound import FcfsBound
from scheduling.interactive_room import NOTHING_OWED, RoomCount, RoomOwed, room_owed
from scheduling.lora_residency import LoraResidency
from scheduling.output_lengths import OutputLengths
from scheduling.preemption import PreemptionEvent, PreemptionMode, choose_victim, victims_in_order
from scheduling.queue import RequestQueue, create_request_queue
from scheduling.queue_order import OrderContext, QueueOrder, QueueOrderName
from scheduling.request import PriorityClass, Request, RequestId, RequestStatus, TokenEvent, finish_reason
from scheduling.snapshot import BlockUse, ClassLoad, SchedulerSnapshot, SpeculationStats, StepCostStats, TierStats
from scheduling.speculation import SpeculationConfig, Speculator, best_draft_count, expected_accepted, may_speculate
from scheduling.step_builder import StepBuilder
from scheduling.step_cost import CostCoefficients, StepWork
from scheduling.step_shaper import ShapingConfig, StepShaper, work_of
from scheduling.tenant_limits import TenantLimits
from scheduling.tenant_load import TenantLoad
from tenancy.tenants import TenantRegistry
from tenancy.vtc import ServiceWeights, VirtualTokenCounter

CLASSES = (PriorityClass.INTERACTIVE, PriorityClass.BATCH)
COEFFICIENT_FIELDS = fields(CostCoefficients)



def check_admissible(geometry: CacheGeometry, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise AdmissionError for a request that could never finish on a runner of this geometry."""
    total = num_prompt_tokens + max_tokens
    if total > geometry.max_model_len:
        raise AdmissionError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
            f"more than the model's context of {geometry.max_model_len} tokens")
    if -(-total // geometry.block_size) > geometry.num_device_blocks:
        raise AdmissionError(
            f"prompt plus max_tokens ({total} tokens) needs more KV memory than the server has "
            f"({geometry.num_device_blocks * geometry.block_size} tokens)")

@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step, decodes and prefill chunks together
    queue_policy: str = "vtc"  # vtc (weighted fair per tenant) or fcfs
    queue_order: QueueOrderName = "srpt"  # within a tenant's line under vtc (scheduling/queue_order.py)
    queue_aging_s: float = 300.0  # hrrn, srpt, lpm: a request waiting this long goes first
    # hrrn, srpt, lpm: a request goes first once its tenant's line has computed this many times the prompt
    # tokens FCFS would have computed by its first token (scheduling/fcfs_bound.py); 0: off.
    queue_fcfs_stretch: float = 1.3
    # A running prompt's chunk while others of its class wait (vLLM's long_prefill_token_threshold): the
    # rest of the step is left to them, so a document does not take every step's budget while the
    # prompts behind it wait. None: a quarter of max_num_batched_tokens.
    long_prefill_token_threshold: int | None = None
    preemption_mode: str = "swap"  # swap (recompute when the CPU pool is full) or recompute
    batch_min_share: float = 0.0  # share of each step's tokens kept for batch when it has work
    service_weights: ServiceWeights = field(default_factory=ServiceWeights)
    kv_share_limit: bool = True  # see Scheduler._over_kv_share
    enable_prefix_caching: bool = True
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    max_loras: int = 0  # LoRA adapter slots on the device (scheduling/lora_residency.py); 0: base model only
    max_pinned_blocks_per_tenant: int = 4096  # cache breakpoints' blocks each tenant may pin at once
    speculation: SpeculationConfig | None = None  # speculative decoding (scheduling/speculation.py); None: off


@dataclass(slots=True)
class SchedulerCounters:
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    preemptions: Counter[str] = field(default_factory=Counter)  # by mode
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


@dataclass(slots=True)
class InteractiveDemand:
    """What waiting interactive requests will take of a step: the tokens running batch work leaves
    them, and the work the shaped budget is opened after (see StepShaper.add_demand)."""

    tokens: int = 0
    work: StepWork = field(default_factory=StepWork)
    requests: list[Request] = field(default_factory=list)  # those counted: lower classes leave them their room


class AdmissionError(ValueError):
    """A request that could never run on this engine (too long for the model or the KV memory)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, geometry: CacheGeometry,
                 tenants: TenantRegistry | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # stamps first_scheduled_time; a virtual clock in simulations
        self.geometry = geometry
        self.tenants = tenants or TenantRegistry.single_default()
        self.pins = CachePins(config.max_pinned_blocks_per_tenant, clock)
        self._pins_expired_at = clock()
        tiers = LowerTiers(geometry.num_host_blocks, geometry.num_disk_blocks, geometry.disk_block_hashes,
                           self.pins.owner_of)
        self.blocks = KVBlockManager(geometry.num_device_blocks, geometry.num_cpu_blocks, geometry.block_size,
                                     config.enable_prefix_caching, tiers, self.pins)
        self.vtc = {c: VirtualTokenCounter(config.service_weights, self.tenants.weight) for c in CLASSES}
        self.output_lengths = OutputLengths()
        self.shaper = StepShaper(config.shaping, geometry.block_size)
        self.fcfs_bound = FcfsBound(config.queue_fcfs_stretch)
        self.order = QueueOrder(config.queue_order, OrderContext(clock, self._predicted_work,
                                                                 self._cached_prefix_tokens, self._token_s,
                                                                 config.queue_aging_s,
                                                                 self.fcfs_bound.is_overdue if config.queue_fcfs_stretch
                                                                 else None))
        self.waiting: dict[PriorityClass, RequestQueue] = {
            c: create_request_queue(config.queue_policy, self.vtc[c], self.order) for c in CLASSES}
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.counters = SchedulerCounters()
        self.preemption_log: deque[PreemptionEvent] = deque(maxlen=10_000)
        self.load = TenantLoad(self.tenants)
        self.limits = TenantLimits(self.tenants, self.load, self.blocks, self.waiting, geometry.num_device_blocks,
                                   config.kv_share_limit)
        self.admission = AdmissionRule(self.limits, self.blocks)
        self._finished_ids: list[str] = []  # told to the runner with the next plan
        self._interactive_seen_at = float("-inf")  # when an interactive request was last unfinished
        self._itl_targets: dict[RequestId, float] = {}  # the running requests whose tenant set an ITL target
        self._arrivals_expected = False
        self._interactive_seen_by_tenant: dict[str, float] = {}  # when each tenant's interactive work last was
        self._tenants_share = False  # whether more than one tenant's interactive work is active or expected
        # When each tenant within long_prompt_chunk_window_s last had unfinished work of any class: the tenants
        # present (see _is_long_prompt_beside_others).
        self._work_seen_by_tenant: dict[str, float] = {}
        self._computing_long_prompts: set[str] = set()  # tenants computing a long interactive prompt, while shared
        self._batch_served_more: frozenset[str] = frozenset()  # see _tenants_served_more
        self._batch_least_served: str | None = None  # the running tenant they are served more than
        self._streams_decoding = False  # whether this step decodes interactive requests (see _spaces_prompts)
        self._short_step = False  # whether this step's running work is predicted within the arrival budget
        self._prompt_started_step = -2  # the step that last started an interactive prompt that stalls streams
        self.lora = LoraResidency(config.max_loras)
        self.speculator = None if config.speculation is None else Speculator(config.speculation)

    # ---- commands -------------------------------------------------------------------------

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError for a request that could never finish here."""
        check_admissible(self.geometry, num_prompt_tokens, max_tokens)

    def fold_service(self, service: Mapping[str, Mapping[str, float]]) -> None:
        """Charge service given elsewhere (by another replica) to the tenants' counters, per class name:
        a tenant's counter then counts all the service it got, wherever it ran."""
        for name, tenants in service.items():
            vtc = self.vtc[PriorityClass(name)]
            for tenant_id, amount in tenants.items():
                vtc.charge_service(tenant_id, amount)

    def hold_for_import(self, chain: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Host blocks for the KV another replica computed of a prompt (cluster/handoff.py): the blocks of
        its hash chain after those the device already holds, each a held host block until
        `release_imports`; (hash, host block) pairs for the caller to fill. None without a host tier."""
        tiers = self.blocks.tiers
        if tiers is None:
            return []
        on_device = 0
        while on_device < len(chain) and self.blocks.device.lookup(chain[on_device]) is not None:
            on_device += 1
        return tiers.hold_for_import(chain[on_device:])

    def release_imports(self, filled: Sequence[bytes], failed: Sequence[bytes]) -> None:
        if self.blocks.tiers is not None:
            self.blocks.tiers.release_imports(filled, failed)

    def add_request(self, request: Request) -> None:
        self.check_admissible(request.num_prompt_tokens, request.max_tokens)
        if request.adapter is not None and not self.config.max_loras:
            raise AdmissionError(f"LoRA adapter '{request.adapter.name}' asked of an engine without LoRA slots")
        backlogged = self.load.added(request)
        if backlogged is not None:  # newly backlogged: no banked credit for idle time
            self.vtc[request.priority].lift(request.tenant_id, backlogged)
        request.status = RequestStatus.WAITING
        request.predicted_output_tokens = self.output_lengths.predict(request)
        self.fcfs_bound.arrived(request)
        self.requests[request.request_id] = request
        self.waiting[request.priority].add(request)

    def _predicted_work(self, request: Request) -> float:
        """Tokens still to compute: its prompt's (or a recomputed request's whole context) and the output
        predicted beyond what it has."""
        return request.num_uncomputed_tokens + max(0, request.predicted_output_tokens - request.num_output_tokens)

    def _cached_prefix_tokens(self, request: Request) -> int:
        return len(self.blocks.cached_prefix(request)) * self.geometry.block_size

    def _token_s(self) -> float:
        coefficients = self.shaper.cost_model.coefficients
        return coefficients.per_token_s if coefficients is not None and coefficients.per_token_s > 0 else 1e-3

    def finish_request(self, request_id: RequestId, status: RequestStatus) -> TokenEvent | None:
        """End a request from outside (abort, or a stop string seen by the API layer)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return self._event(request, ())

    def has_work(self) -> bool:
        return bool(self.running or self.swapped or any(len(q) for q in self.waiting.values()))

    @property
    def has_untold_finishes(self) -> bool:
        """Finished requests the runner has not been told of by a plan yet: it keeps per-request
        state (seeded generators, grammar matchers) until it is."""
        return bool(self._finished_ids)

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self.counters.num_steps += 1
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self._expire_pins()
        self._note_interactive_traffic()
        step = self._fill(plan)
        # No proposals in a step that starts a prompt stalling the streams: beside it they look cheap, but
        # the streams they move a few tokens on drift together again (see _spaces_prompts).
        if step is not None and self.speculator is not None and self._prompt_started_step != self.counters.num_steps:
            self._speculate(step, self.speculator)
        plan.tier_copies = self.blocks.take_tier_copies()  # every allocation of the step is made
        return plan

    def _expire_pins(self) -> None:
        """Once a second: a pin past its TTL no longer counts in its tenant's quota (it protects nothing
        already, see CachePins.is_pinned)."""
        if len(self.pins) and self.clock() - self._pins_expired_at >= 1.0:
            self.pins.expire()
            self._pins_expired_at = self.clock()

    def _fill(self, plan: StepPlan) -> StepBuilder | None:
        """The step's work; its builder, unless the step preempted (then nothing else is added to it)."""
        step = StepBuilder(plan, self.config.max_num_batched_tokens, self.blocks,
                           batch_floor_tokens=self._batch_reserve())
        made_room, interactive_demand = self._make_room_for_interactive(plan, step.tokens_left)
        ordered, num_interactive_decodes = self._running_in_order()
        self._batch_least_served, self._batch_served_more = self._tenants_served_more(ordered)
        after_admission = self._served_past_waiting_batch(ordered)
        if self._schedule_running(step, interactive_demand, ordered, num_interactive_decodes, after_admission):
            return None  # bringing work in right after pushing work out would only thrash
        self._open_shaped_budget(step, interactive_demand)
        self._short_step = bool(len(self.waiting[PriorityClass.INTERACTIVE])) and self._is_short(step.plan)
        # Room made for interactive requests is theirs in this very plan (the runner swaps out before
        # the forward); batch work waits for the next step. What must stay true: every swap-out of a
        # plan is decided before any swap-in, so no CPU block is freed and reused within one plan.
        self._resume_and_admit(step, (PriorityClass.INTERACTIVE,) if made_room else CLASSES, interactive_demand)
        if after_admission < len(ordered):
            self._schedule_in_order(step, interactive_demand, ordered, after_admission, len(ordered))
        return step

    def _speculate(self, step: StepBuilder, speculator: Speculator) -> None:
        """Proposed tokens for the step's decodes, last, from what the step left: a proposal never takes a
        prompt's tokens or blocks. Each decode verifies the number of its proposals that makes the step's
        expected tokens per second highest (scheduling/speculation.py), interactive ones first."""
        plan = step.plan
        decodes = [s for s in plan.sequences if len(s.token_ids) == 1 and s.needs_sample]
        if decodes:  # else nothing to predict: a step of prompt chunks alone
            self._add_proposals(step, speculator, decodes)
        if speculator.drafts_with_model:
            self._ask_for_proposals(plan, speculator)

    def _add_proposals(self, step: StepBuilder, speculator: Speculator, decodes: list[ScheduledSequence]) -> None:
        """Each decode's proposals, in the plan's order (interactive first), while they pay and fit."""
        plan, cost_model = step.plan, self.shaper.cost_model
        predicted_s = cost_model.predict(work_of(plan, swaps=False)) if cost_model.coefficients is not None else None
        expected_tokens = float(sum(1 for seq in plan.sequences if seq.needs_sample))
        for seq in decodes:
            request = self.requests.get(seq.request_id)  # type: ignore[call-overload]  # a str that is a RequestId
            cap = min(speculator.config.num_speculative_tokens, step.tokens_left,
                      request.max_tokens - request.num_output_tokens - 1,
                      self.geometry.max_model_len - len(request.token_ids) - 1) if request is not None else 0
            if cap <= 0 or not may_speculate(request.sampling):
                continue
            rate = speculator.acceptance_rate(request.request_id)
            k, added_s = self._draft_count(cap, rate, seq, step, expected_tokens, predicted_s)
            if k <= 0:  # not even the most proposals would pay (a compute-bound step): none is looked for
                continue
            drafts = speculator.propose(request.request_id, request.tenant_id, request.token_ids, k)
            if not drafts:
                continue
            if len(drafts) < k:
                k, added_s = self._draft_count(len(drafts), rate, seq, step, expected_tokens, predicted_s)
            time_left = self._draft_time_left(step, request)
            if time_left is not None:
                k = k if added_s <= time_left else 0
            k = self._room_for_drafts(request, k)
            if k <= 0:
                continue
            seq.token_ids += drafts[:k]
            seq.num_draft_tokens = k
            seq.block_table = self.blocks.block_table(request.request_id)
            step.tokens_left -= k
            step.num_tokens += k
            if step.shaped_time_left_s is not None:
                step.shaped_time_left_s = max(0.0, step.shaped_time_left_s - added_s)
            if step.served_more_time_left_s is not None and self._is_served_more(request, step):
                step.served_more_time_left_s = max(0.0, step.served_more_time_left_s - added_s)
            if predicted_s is not None:
                predicted_s += added_s
            expected_tokens += expected_accepted(rate, k)

    def _draft_time_left(self, step: StepBuilder, request: Request) -> float | None:
        """The time a request's proposals may add to the step: what shaping left, and for a tenant served
        more, its share (see _tenants_served_more); None when nothing bounds it."""
        shaped, served_more = step.shaped_time_left_s, step.served_more_time_left_s
        if served_more is None or not self._is_served_more(request, step):
            return shaped
        return served_more if shaped is None else min(shaped, served_more)

    def _ask_for_proposals(self, plan: StepPlan, speculator: Speculator) -> None:
        """With a draft model: each sampled sequence that may speculate asks the runner for proposals for its
        next step, carrying its request's tokens (gpu/draft.py reads what it lacks of them)."""
        for seq in plan.sequences:
            request = self.requests.get(seq.request_id)  # type: ignore[call-overload]  # a str that is a RequestId
            if (seq.needs_sample and request is not None and may_speculate(request.sampling)
                    and speculator.wants_proposals(request.request_id)):
                seq.num_proposals_wanted = speculator.config.num_speculative_tokens
                seq.prompt_token_ids = tuple(request.prompt_token_ids)
                seq.output_token_ids = tuple(request.output_token_ids)

    def _draft_count(self, num_drafts: int, rate: float, seq: ScheduledSequence, step: StepBuilder,
                     expected_tokens: float, predicted_s: float | None) -> tuple[int, float]:
        """How many of num_drafts proposals pay, and the time they add (see best_draft_count); all of them
        while nothing is measured."""
        cost_model = self.shaper.cost_model
        if cost_model.coefficients is None or predicted_s is None:
            return num_drafts, 0.0
        return best_draft_count(num_drafts, rate, seq.start_position, step.num_tokens, expected_tokens, predicted_s,
                                cost_model.coefficients, cost_model.residual)

    def _room_for_drafts(self, request: Request, k: int) -> int:
        """k, or as many proposals as the request's blocks hold when no fresh block is free for them."""
        if k <= 0 or self.blocks.allocate(request, 1 + k):
            return k
        held = self.blocks.num_device_blocks(request.request_id) * self.geometry.block_size
        return min(k, held - request.num_computed_tokens - 1)

    def _batch_reserve(self) -> int:
        """batch_min_share's tokens while any batch request is unfinished (waiting, running or swapped)."""
        has_batch = self.load.has_unfinished(PriorityClass.BATCH)
        return int(self.config.batch_min_share * self.config.max_num_batched_tokens) if has_batch else 0

    def _make_room_for_interactive(self, plan: StepPlan, budget: int) -> tuple[bool, InteractiveDemand]:
        """Preempt running batch requests until the interactive requests that fit this step's budget have
        the LoRA slots, the room under their tenants' max_concurrent, the blocks and the sequence slots
        they need. Returns whether any was preempted, and what those interactive requests will take of the
        step (running batch work leaves them its tokens, lower classes their room)."""
        if not self.load.has_unfinished(PriorityClass.BATCH) and not self._may_shape():
            return False, InteractiveDemand()  # no batch work to preempt, hold back or keep out: nobody reads it
        room = RoomCount(self.lora, self.load, self.running)
        demand, blocks_needed = self._count_interactive_demand(budget, room)
        preempted = self._give_way(room.lora_victims(), plan)
        preempted = self._give_way(room.concurrency_victims(), plan) or preempted
        victims: Iterator[Request] | None = None
        while demand.requests and self.load.num_running(PriorityClass.BATCH) and (
                blocks_needed > self.blocks.device.num_free
                or len(self.running) + len(demand.requests) > self.config.max_num_seqs):
            if victims is None:  # choose_victim's order, sorted once for a burst of preemptions
                victims = iter(victims_in_order(r for r in self.running if r.priority is PriorityClass.BATCH))
            self._preempt(next(victims), plan, PriorityClass.INTERACTIVE)
            preempted = True
        return preempted, demand

    def _count_interactive_demand(self, budget: int, room: RoomCount) -> tuple[InteractiveDemand, int]:
        """The waiting interactive requests that fit this step's budget and could start once running batch
        work gives way, in the order the step starts them, and the device blocks they need. Counted by the
        admission rule with the room preemption could make (see scheduling/admission.py): one it holds back
        is not counted, since making room for it would only swap batch work out and back in."""
        demand, blocks_needed = InteractiveDemand(), 0
        passed_over: set[str] = set()
        for request in self._waiting_interactive_in_order():
            if demand.tokens >= budget:
                break
            verdict = self.admission.verdict(request, budget - demand.tokens, room, passed_over)
            if verdict.hold is Hold.TENANT:
                passed_over.add(request.tenant_id)
            if verdict.hold is not None:
                continue
            room.add(request)
            demand.requests.append(request)
            blocks_needed += verdict.num_blocks
            if self._is_shared_long_prompt(request, verdict.num_new):
                # Shaped once admitted: it takes from the budget (at least a block), not before it.
                demand.tokens += min(verdict.num_new, self.geometry.block_size)
                continue
            demand.tokens += verdict.num_new
            self.shaper.add_demand(demand.work, verdict.num_new, request.num_computed_tokens)
        return demand, blocks_needed

    def _give_way(self, victims: list[Request], plan: StepPlan) -> bool:
        """Preempt these batch requests for interactive work; whether there were any."""
        for victim in victims:
            self._preempt(victim, plan, PriorityClass.INTERACTIVE)
        return bool(victims)

    def _waiting_interactive_in_order(self) -> Iterable[Request]:
        yield from (r for r in self.swapped if r.priority is PriorityClass.INTERACTIVE)
        yield from self.waiting[PriorityClass.INTERACTIVE]

    def _may_shape(self) -> bool:
        return self.shaper.may_shape(self.load.has_unfinished(PriorityClass.INTERACTIVE),
                                     self.load.has_unfinished(PriorityClass.BATCH), self._arrivals_expected,
                                     self._tenants_share)

    def _note_interactive_traffic(self) -> None:
        """Once a step: whether interactive requests may arrive (see StepShaper.expects_arrivals), and
        whether more than one tenant's may (then tenants' long prompts are shaped)."""
        now = self.clock()
        if self.load.has_unfinished(PriorityClass.INTERACTIVE):
            self._interactive_seen_at = now
        self._arrivals_expected = self.shaper.expects_arrivals(now - self._interactive_seen_at)
        seen = self._interactive_seen_by_tenant
        _date_tenants(seen, self.load.backlogged(PriorityClass.INTERACTIVE), now, self.shaper.expects_arrivals)
        self._tenants_share = len(seen) > 1
        chunk_window_s = self.shaper.config.long_prompt_chunk_window_s
        _date_tenants(self._work_seen_by_tenant, (t for c in CLASSES for t in self.load.backlogged(c)), now,
                      lambda seconds: seconds <= chunk_window_s)
        self._computing_long_prompts = {
            r.tenant_id for r in self.running if r.priority is PriorityClass.INTERACTIVE
            and r.num_computed_tokens < r.num_prompt_tokens and self.shaper.is_long_prompt(r)
        } if self._tenants_share else set()

    def _waits_its_turn(self, request: Request, num_new: int, step: StepBuilder) -> bool:
        """Whether a request did not start because it is a tenant's long prompt whose turn this step is not."""
        return not step.long_prompt_turn and self._is_shared_long_prompt(request, num_new)

    def _is_shared_long_prompt(self, request: Request, num_new: int) -> bool:
        """Whether this is a chunk of a long interactive prompt in steps other tenants' work shares, from a
        tenant that has had as much interactive service as one of them or more (its VTC counter is not the
        lowest), and that one computes no long prompt of its own: shaped (see step_shaper.py). The tenant
        served least is never held back, nor is one tenant alone. Nor is anyone for a tenant computing a
        long prompt: its steps are long with its own prompt already, and when every tenant sends long
        prompts VTC shares the steps (turns by service had the mixed-length trace's documents wait twice as
        long, docs/loadtest.md). Ties are held back: a tenant newly backlogged is lifted to the others'
        counters."""
        if not (self._tenants_share and self._is_long_prompt_chunk(request, num_new)):
            return False
        vtc = self.vtc[PriorityClass.INTERACTIVE]
        counter = vtc.get(request.tenant_id)
        return any(vtc.get(t) <= counter and t not in self._computing_long_prompts
                   for t in self._interactive_seen_by_tenant if t != request.tenant_id)

    def _open_shaped_budget(self, step: StepBuilder, interactive_demand: InteractiveDemand,
                            opened_for: PriorityClass = PriorityClass.BATCH) -> None:
        tenant_target_s = min(self._itl_targets.values()) if self._itl_targets else None
        self.shaper.open_budget(step, interactive_demand.work, self._may_shape(), opened_for, tenant_target_s)

    def _shaped(self, step: StepBuilder, request: Request, num_new: int, interactive_demand: InteractiveDemand,
                swap_in_blocks: int = 0) -> int:
        """num_new, or fewer when step shaping holds the request's work back (see step_shaper.py)."""
        if self._is_long_prompt_beside_others(request, num_new):
            num_new = self.shaper.long_prompt_chunk(step, request, num_new, interactive_demand.work)
        long_prompt = self._is_shared_long_prompt(request, num_new)
        served_more = self._is_served_more(request, step)
        may_shape = (long_prompt or self.shaper.shapes(request)) and self._may_shape()
        if not (may_shape or served_more):
            return num_new
        if may_shape:
            self._open_shaped_budget(step, interactive_demand, request.priority)
        if served_more:
            self.shaper.open_served_more_budget(step)
        cross_tenant = self._is_cross_tenant(step, request)
        return self.shaper.fit(step, request, num_new, swap_in_blocks, long_prompt, cross_tenant, served_more)

    def _is_long_prompt_chunk(self, request: Request, num_new: int) -> bool:
        return num_new > 1 and request.priority is PriorityClass.INTERACTIVE and self.shaper.is_long_prompt(request)

    def _is_long_prompt_beside_others(self, request: Request, num_new: int) -> bool:
        """Whether this is a chunk of a long interactive prompt while other tenants use the server (one had
        unfinished work, of any class, within long_prompt_chunk_window_s) and none computes a long prompt of
        its own. Its steps are kept short (StepShaper.long_prompt_chunk), for the others' requests may
        arrive at any moment. One tenant alone loses nothing to chunks: its long prompt only holds up its
        own requests. Nor do tenants that all send long prompts: their steps are long already, and on the
        mixed-length trace past capacity chunks for everyone read a TTFT p50 of 39 s against 18 s without
        (one run each, docs/loadtest.md)."""
        if not self._is_long_prompt_chunk(request, num_new):
            return False
        tenant_id, present = request.tenant_id, self._work_seen_by_tenant
        if not (len(present) > 1 or (present and tenant_id not in present)):
            return False
        return not any(t != tenant_id for t in self._computing_long_prompts)

    def _is_cross_tenant(self, step: StepBuilder, request: Request) -> bool:
        """Whether this is batch work in a step that holds another tenant's interactive decodes: their gaps
        are what the cross-tenant target keeps. Another tenant's interactive prompts, waiting or part-way,
        are no stream to slow: counted, a neighbour's long prompts (one after another, each waiting for its
        turns) held a light tenant's own batch beside its own streams to the cross-tenant share, and its
        8-line batch took 4.3x as long as alone (docs/loadtest.md)."""
        if request.priority is not PriorityClass.BATCH:
            return False
        tenants = self._decoding_tenants(step)
        return len(tenants) > 1 or (len(tenants) == 1 and request.tenant_id not in tenants)

    def _decoding_tenants(self, step: StepBuilder) -> frozenset[str]:
        """The tenants with interactive decodes in the step, found once a step: its interactive work is all in
        the plan before any batch work."""
        if step.decoding_tenants is None:
            step.decoding_tenants = self._interactive_decoding_tenants(step.plan)
        return step.decoding_tenants

    def _interactive_decoding_tenants(self, plan: StepPlan) -> frozenset[str]:
        requests = self.requests
        tenants = set()
        for seq in plan.sequences:
            request = requests[RequestId(seq.request_id)]
            if request.priority is PriorityClass.INTERACTIVE and seq.start_position >= request.num_prompt_tokens:
                tenants.add(request.tenant_id)
        return frozenset(tenants)

    def _is_served_more(self, request: Request, step: StepBuilder) -> bool:
        """Whether the request's batch work is held to the served-more share in this step: its tenant is
        served more (see _tenants_served_more), and the tenant served least has batch work in the step for
        the share to keep short. Where that tenant's work is held out (beside another tenant's streams,
        by the cross-tenant bound), the share would keep nothing short: the steps' room beside the streams
        went unused, and a light tenant's batch beside its own streams, served more than a neighbour's four
        background responses, decoded at 9 tokens a second against 25 alone (docs/loadtest.md)."""
        return (request.priority is PriorityClass.BATCH and request.tenant_id in self._batch_served_more
                and self._batch_least_served in step.batch_tenants)

    def _tenants_served_more(self, ordered: list[Request]) -> tuple[str | None, frozenset[str]]:
        """The running tenant its batch queue has served least, and the tenants whose batch work a step
        holding that one's may hold to a share of the step (see StepShaper.open_served_more_budget): those
        running more batch requests than it, and served more. Its waiting requests are admitted before
        their work (see _served_past_waiting_batch), and what it runs gains nothing from more rows beside
        it, only from shorter steps. None under FCFS, or with one tenant's batch running, or between
        tenants running as many rows each (their steps stay full)."""
        if self.config.queue_policy != "vtc" or self.load.num_running(PriorityClass.BATCH) < 2:
            return None, frozenset()
        rows = Counter(r.tenant_id for r in ordered if r.priority is PriorityClass.BATCH)
        if len(rows) < 2:
            return None, frozenset()
        vtc = self.vtc[PriorityClass.BATCH]
        least = min(rows, key=vtc.get)
        served = vtc.get(least)
        return least, frozenset(t for t, n in rows.items() if n > rows[least] and vtc.get(t) > served)

    def _schedule_running(self, step: StepBuilder, interactive_demand: InteractiveDemand, ordered: list[Request],
                          num_interactive_decodes: int, stop: int) -> bool:
        """The running requests `ordered` (see _running_in_order) before `stop`: interactive before batch,
        decodes before prefill chunks. Returns whether any was preempted.

        Runs for every running request at every step, so the common case is kept to a few operations
        each: interactive decodes that all fit the token budget are taken in bulk (shaping never holds
        them back), a request whose blocks already have room (15 decodes in 16) needs no call to the
        block manager beyond reading its table, and a preempted request is skipped by its status."""
        self._streams_decoding = num_interactive_decodes > 0
        preempted = False
        first_general = 0
        if num_interactive_decodes <= step.tokens_left - step.batch_floor_tokens:
            preempted = self._schedule_interactive_decodes(step, ordered, num_interactive_decodes)
            first_general = num_interactive_decodes
        return self._schedule_in_order(step, interactive_demand, ordered, first_general, stop) or preempted

    def _schedule_in_order(self, step: StepBuilder, interactive_demand: InteractiveDemand, ordered: list[Request],
                           start: int, stop: int) -> bool:
        """The running requests ordered[start:stop], each as much of its next work as the step's tokens,
        chunk caps and shaping allow. Running batch work leaves `interactive_demand` tokens for waiting
        interactive requests (less its batch_min_share). Returns whether any was preempted."""
        reserve = step.batch_floor_tokens
        preempted = False
        held_for_interactive = min(interactive_demand.tokens, self.config.max_num_batched_tokens - reserve)
        chunk_cap = {c: self._chunk_cap(c) for c in CLASSES}
        may_hold = self._may_shape() or bool(self._batch_served_more)  # shaping or a served-more share
        table_of, block_size = self.blocks.device_tables.get, self.geometry.block_size
        interactive, running = PriorityClass.INTERACTIVE, RequestStatus.RUNNING
        for index in range(start, stop):
            request = ordered[index]
            if request.status is not running:  # preempted earlier in this step
                continue
            computed = request.num_computed_tokens
            num_new = len(request.token_ids) - computed
            cap = step.tokens_left - (reserve if request.priority is interactive else held_for_interactive)
            if num_new > cap:
                num_new = cap
            if num_new > chunk_cap[request.priority]:
                num_new = chunk_cap[request.priority]
            if may_hold or (num_new > 1 and request.priority is interactive):  # shaping, or a long prompt's chunk
                num_new = self._shaped(step, request, num_new, interactive_demand)
            if num_new <= 0:
                continue
            table = table_of(request.request_id, ())
            if computed + num_new > len(table) * block_size:
                allocated, preempted_some = self._allocate_or_preempt(request, num_new, ordered[index + 1:], step.plan)
                preempted = preempted or preempted_some
                if not allocated:
                    continue
                table = table_of(request.request_id, ())
            step.add(request, num_new, table)
        return preempted

    def _chunk_cap(self, priority: PriorityClass) -> int:
        """The most tokens a running prompt of this class computes in this step: the long-prefill threshold
        while requests of its class wait, so they start beside it; else the whole budget."""
        if not len(self.waiting[priority]):
            return self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        return max(1, self.config.max_num_batched_tokens // 4) if threshold is None else threshold

    def _schedule_interactive_decodes(self, step: StepBuilder, ordered: list[Request], count: int) -> bool:
        """The first `count` requests of `ordered`, interactive ones decoding a token each, when they all fit
        the token budget: only their blocks are checked, and their sequences are added in one go. Returns
        whether any request was preempted (for the blocks of one of them)."""
        table_of, block_size, running = self.blocks.device_tables.get, self.geometry.block_size, RequestStatus.RUNNING
        decodes: list[Request] = []
        tables: list[tuple[int, ...]] = []
        preempted = False
        for index in range(count):
            request = ordered[index]
            if request.status is not running:  # preempted earlier in this step
                continue
            table = table_of(request.request_id, ())
            if request.num_computed_tokens >= len(table) * block_size:  # its next token starts a new block
                allocated, preempted_some = self._allocate_or_preempt(request, 1, ordered[index + 1:], step.plan)
                preempted = preempted or preempted_some
                if not allocated:
                    continue
                table = table_of(request.request_id, ())
            decodes.append(request)
            tables.append(table)
        step.add_decodes(decodes, tables)
        return preempted

    def _allocate_or_preempt(self, request: Request, num_new: int, later: list[Request], plan: StepPlan
                             ) -> tuple[bool, bool]:
        """Blocks for the request's next num_new tokens, preempting the request that gives way first (among
        it and those after it in this step's order) until they fit. Returns whether the request got its
        blocks (it may have given way itself), and whether any request was preempted."""
        preempted = False
        while not self.blocks.allocate(request, num_new):
            candidates = [request, *(r for r in later if r.status is RequestStatus.RUNNING)]
            victim = choose_victim(candidates, request.priority)
            assert victim is not None  # the request itself is always a candidate
            self._preempt(victim, plan, request.priority)
            preempted = True
            if victim is request:
                return False, True
        return True, preempted

    def _running_in_order(self) -> tuple[list[Request], int]:
        """Interactive before batch, decodes before prefill chunks, and otherwise in the order they started
        running, batch work the least served tenant's first: a stable sort, made with list comprehensions
        instead of a key function call per request. Also returns how many interactive decodes lead the list."""
        running = self.running
        if self.load.num_running(PriorityClass.BATCH):
            by_class = [[r for r in running if r.priority is p] for p in CLASSES]
        else:
            by_class = [running]  # all interactive
        ordered: list[Request] = []
        num_interactive_decodes = 0
        for index, requests in enumerate(by_class):
            decodes = [r for r in requests if len(r.token_ids) - r.num_computed_tokens == 1]
            if index == 0:  # the interactive requests (all of them when no batch request runs)
                num_interactive_decodes = len(decodes)
            in_class = decodes
            if len(decodes) < len(requests):  # prefill chunks (and none left to compute, which are skipped)
                in_class = decodes + self._in_each_tenants_order([r for r in requests
                                                                  if len(r.token_ids) - r.num_computed_tokens != 1])
            ordered += in_class if index == 0 else self._least_served_first(in_class, PriorityClass.BATCH)
        return ordered, num_interactive_decodes

    def _served_past_waiting_batch(self, ordered: list[Request]) -> int:
        """Where, in `ordered`, the running batch work of tenants served more than a tenant with batch
        requests waiting begins (len(ordered) if none): that work takes what the step leaves once the
        waiting requests have been offered their room. Running work takes its room before admission, so
        one tenant's flood, running first, had taken every step's room, and another tenant's small batch
        waited behind it however little its counter read (simulated: 423 steps, 209 with the room by the
        fair queue). Work the fair queue says comes first now starts first; a running request passed over
        keeps its blocks and its place."""
        waiting = self.waiting[PriorityClass.BATCH]
        if self.config.queue_policy != "vtc" or not len(waiting) or not self.load.num_running(PriorityClass.BATCH):
            return len(ordered)
        vtc = self.vtc[PriorityClass.BATCH]
        least_waiting = min(vtc.get(t) for t in waiting.tenants())
        for index in range(len(ordered) - 1, -1, -1):  # batch work is last, the least served tenant's first
            request = ordered[index]
            if request.priority is not PriorityClass.BATCH or vtc.get(request.tenant_id) <= least_waiting:
                return index + 1
        return 0

    def _least_served_first(self, requests: list[Request], priority: PriorityClass) -> list[Request]:
        """Running requests of one class, the tenant its fair queue has served least first (each tenant's in
        the order given). Shaping gives a step's room to running batch work in this order until it is spent:
        in the order they started, one tenant's flood admitted first took the room of every step.
        Interactive work is not reordered: its decodes are never held back."""
        tenants = {r.tenant_id for r in requests}
        if len(tenants) < 2:
            return requests
        vtc = self.vtc[priority]
        served = {tenant_id: vtc.get(tenant_id) for tenant_id in tenants}
        return sorted(requests, key=lambda r: served[r.tenant_id])  # stable: each tenant's order kept

    def _in_each_tenants_order(self, prompts: list[Request]) -> list[Request]:
        """Running prompts, each tenant's in its queue order: a tenant's short prompt started after its
        document is computed first, as it would have been admitted first had it waited (on a server
        with room for all, every prompt starts running as it arrives, and the line never forms). The
        places of the tenants among themselves are kept: the order never moves service between tenants."""
        if len(prompts) < 2 or self.order.name in ("fcfs", "lpm"):
            return prompts
        by_tenant: dict[str, list[Request]] = {}
        for request in prompts:
            by_tenant.setdefault(request.tenant_id, []).append(request)
        ranked = {tenant: iter(self.order.ranked(own)) for tenant, own in by_tenant.items()}
        return [next(ranked[request.tenant_id]) for request in prompts]

    def _resume_and_admit(self, step: StepBuilder, classes: Iterable[PriorityClass],
                          interactive_demand: InteractiveDemand) -> None:
        owed = NOTHING_OWED
        for priority in classes:
            if not self._start_class(step, priority, owed):
                return  # requests of this class still wait: lower classes do not jump ahead
            owed = room_owed(interactive_demand.requests)  # room was made for them: lower classes leave it

    def _start_class(self, step: StepBuilder, priority: PriorityClass, owed: RoomOwed) -> bool:
        """Resume this class's swapped requests (oldest preemption first), then admit its waiting ones (in
        queue order: VTC across tenants), as the admission rule allows with the room as it is, less what is
        `owed` to waiting interactive requests. False if some must wait for the next step."""
        room = RoomNow(self.lora, self.load, owed)
        passed_over: set[str] = set()
        queue = self.waiting[priority]
        cross_tenant_full = False  # another tenant's batch found no room beside the streams: none will
        with queue.passing_over():
            for request in self._not_running_in_order(priority, passed_over):
                if len(self.running) >= self.config.max_num_seqs or step.tokens_left <= 0:
                    return False
                verdict = self.admission.verdict(request, step.tokens_left, room, passed_over)
                if verdict.hold is Hold.REQUEST:
                    continue  # swapped: it waits for a LoRA slot or room under max_concurrent, holding neither
                swapped = request.status is RequestStatus.SWAPPED
                # A waiting request whose cached prefix continues on disk is admitted once it is read.
                if (verdict.hold is Hold.TENANT or (not swapped and self.blocks.read_from_disk(request))
                        or (cross_tenant_full and self._is_cross_tenant(step, request))):
                    passed_over.add(request.tenant_id)
                    continue
                stalls = not swapped and self._stalls_streams(request, verdict.num_new)
                if stalls and self._spaces_prompts():
                    return False
                started = self._resume(request, verdict, step) if swapped else self._admit(request, step)
                if started and stalls:
                    self._prompt_started_step = self.counters.num_steps
                if not started and self._waits_its_turn(request, verdict.num_new, step):
                    passed_over.add(request.tenant_id)  # the other tenants' prompts are not held behind it
                elif not started and self._is_cross_tenant(step, request) and self._streams_batch_waits(step):
                    cross_tenant_full = True  # the streams' own tenants' batch, bound by their target, may fit
                    passed_over.add(request.tenant_id)
                elif not started:
                    return False
        return True

    def _streams_batch_waits(self, step: StepBuilder) -> bool:
        """Whether a tenant whose streams decode in this step has batch work waiting or swapped out. Its work
        beside its own streams is bound by their target, not the cross-tenant one: where another tenant's
        batch found no room, it may. Else, with the other tenant first in VTC's order, it would wait until
        that tenant's counter caught up, which the cross-tenant bound slows (docs/preemption.md)."""
        tenants = self._decoding_tenants(step)
        waiting = self.waiting[PriorityClass.BATCH].tenants()
        return any(t in waiting for t in tenants) or any(
            r.priority is PriorityClass.BATCH and r.tenant_id in tenants for r in self.swapped)

    def _spaces_prompts(self) -> bool:
        """Whether a prompt that stalls the streams waits, so as not to start beside another, or right behind
        one while streams decode, in steps otherwise short. A prompt that costs more than a lone decode stalls every
        stream's step alike, so prompts started together, or a step apart, leave their streams a token
        apart: with replies of equal length they end together and send their next prompts together again,
        each waiting for the others' prompt steps (closed-loop streams so locked read 3.2x a lone first
        token). Started one at a time with a decode step between, the streams end two steps apart, and
        each next prompt arrives while no other is computed; prompts that arrive together also get their
        first tokens sooner on average than computed together. In steps long already (many rows, or a long
        prompt's chunk: a line past capacity) a step's wait would cost more than it keeps apart."""
        started, now = self._prompt_started_step, self.counters.num_steps
        return self._short_step and (started == now or (started == now - 1 and self._streams_decoding))

    def _stalls_streams(self, request: Request, num_new: int) -> bool:
        """Whether this is an interactive prompt whose num_new tokens cost more than a lone decode step: a step
        computing it stalls the streams. None does while no lone decode is measured."""
        if request.priority is not PriorityClass.INTERACTIVE:
            return False
        lone_decode_s = self.shaper.cost_model.lone_decode_s
        return lone_decode_s is not None and num_new * self._token_s() > lone_decode_s

    def _is_short(self, plan: StepPlan) -> bool:
        """Whether the plan's work so far is predicted within the arrival budget (none is while the cost
        model has no coefficients)."""
        budget_s = self.shaper.arrival_budget_s()
        if budget_s is None:
            return False
        predicted_s = self.shaper.cost_model.predict(work_of(plan, swaps=False))
        return predicted_s is not None and predicted_s <= budget_s

    def _not_running_in_order(self, priority: PriorityClass, passed_over: Container[str]) -> Iterator[Request]:
        """The class's swapped requests, then its waiting ones as the queue offers them. A waiting request
        yielded must be started (it leaves the queue) or its tenant passed over before the next is asked."""
        yield from [r for r in self.swapped if r.priority is priority]
        queue = self.waiting[priority]
        while (request := queue.peek(passed_over)) is not None:
            yield request

    def _resume(self, request: Request, verdict: Verdict, step: StepBuilder) -> bool:
        """Swap a request back in with the verdict's tokens, if its blocks are free and shaping allows."""
        if verdict.num_blocks > self.blocks.device.num_free:
            return False
        num_new = self._shaped(step, request, verdict.num_new, InteractiveDemand(),
                               self.blocks.num_cpu_blocks(request.request_id))
        if num_new <= 0:
            return False
        pairs = self.blocks.swap_in(request)
        if pairs is None or not self.blocks.allocate(request, num_new):  # not in an assert: python -O drops those
            raise RuntimeError(f"{request.request_id}: swap-in refused after its blocks were counted free")
        step.plan.swap_in.extend(pairs)
        self.counters.blocks_swapped_in += len(pairs)
        self.swapped.remove(request)
        self._start_running(request, step.plan)
        step.add(request, num_new)
        return True

    def _admit(self, request: Request, step: StepBuilder) -> bool:
        """Start a waiting request: share its cached prefix, allocate the rest of its first chunk."""
        cached_prefix = self.blocks.cached_prefix(request)
        copied_up = self.blocks.host_prefix(request, len(cached_prefix))  # its prefix goes on in host memory
        num_cached = (len(cached_prefix) + len(copied_up)) * self.geometry.block_size
        num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, step.tokens_left)
        num_new = self._shaped(step, request, num_new, InteractiveDemand(), len(copied_up))  # a copy up costs
        if num_new <= 0 or not self.blocks.allocate(request, num_new, cached_prefix, copied_up):
            return False
        request.num_computed_tokens += num_cached
        self.blocks.record_prefix_query(request, num_cached)
        if request.cache_pin_tokens:  # a hit on a breakpoint keeps it for another TTL
            self.blocks.pin_breakpoint(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        if request.num_preemptions == 0:  # usage reports the first admission's hits
            request.num_cached_tokens = num_cached
            self.vtc[request.priority].charge(request.tenant_id, 0, 0, num_cached_prompt=num_cached)
            self.fcfs_bound.found_cached(request, num_cached)
        self.waiting[request.priority].remove(request)
        self._start_running(request, step.plan)
        step.add(request, num_new)
        return True

    def _start_running(self, request: Request, plan: StepPlan) -> None:
        if request.adapter is not None:  # the caller checked lora.can_acquire
            grant = self.lora.acquire(request.adapter)
            assert grant is not None
            request.lora_slot = grant.slot
            if grant.needs_load:
                plan.lora_loads.append((grant.slot, request.adapter))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.load.started_running(request)
        if request.itl_target_s is not None:
            self._itl_targets[request.request_id] = request.itl_target_s

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        self._itl_targets.pop(request.request_id, None)
        self.load.stopped_running(request)
        if request.lora_slot != BASE_MODEL_SLOT:  # a resumed request takes a slot again (maybe another)
            self.lora.release(request.lora_slot)
            request.lora_slot = BASE_MODEL_SLOT

    def _preempt(self, victim: Request, plan: StepPlan, for_class: PriorityClass) -> None:
        """Swap the victim's KV to the CPU pool; if the pool is full (or swap is off), recompute."""
        num_blocks = self.blocks.num_device_blocks(victim.request_id)
        pairs = self.blocks.swap_out(victim) if self.config.preemption_mode == "swap" else None
        self._stop_running(victim)
        victim.num_preemptions += 1
        if pairs is not None:
            plan.swap_out.extend(pairs)
            self.counters.blocks_swapped_out += len(pairs)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            mode = PreemptionMode.SWAP
        else:
            self.blocks.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting[victim.priority].prepend(victim)
            mode = PreemptionMode.RECOMPUTE
        self.counters.preemptions[mode.value] += 1
        self.preemption_log.append(PreemptionEvent(self.counters.num_steps, victim.request_id,
                                                   victim.priority, mode, num_blocks, for_class))

    # ---- update ---------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Advance the counters by what the step computed; a token event per sampled request.

        Runs for every running request at every step, so the common decode does little, inline: its
        tenant's sampled tokens are counted here and charged once per tenant at the end, and the prefix
        cache is asked to register blocks only when a block was completed."""
        events: list[TokenEvent] = self._end_failed_lora_loads(result.failed_lora_loads) \
            if result.failed_lora_loads else []  # nearly always empty: no call on the common step
        if result.lost_disk_blocks or result.failed_disk_reads:
            self.blocks.tiers_lost(result.lost_disk_blocks, result.failed_disk_reads)
        if result.forward_changed:
            self.shaper.cost_model.forget()
        sampled_by_class: dict[PriorityClass, dict[str, int]] = {c: {} for c in CLASSES}  # per tenant
        requests, block_size, max_model_len = self.requests, self.geometry.block_size, self.geometry.max_model_len
        sampled_tokens, logprobs_of, prompt_logprobs_of = (result.sampled_token_ids, result.logprobs,
                                                           result.prompt_logprobs)
        running = RequestStatus.RUNNING
        new_event = tuple.__new__  # a TokenEvent from its nine fields, without NamedTuple's keyword handling
        for seq in plan.sequences:
            request_id = seq.request_id
            request = requests.get(request_id)  # type: ignore[call-overload]  # a str that is a RequestId
            if request is None or request.status is not running:
                continue
            if seq.num_draft_tokens:
                events.append(self._take_verified(request, seq, result, sampled_by_class[request.priority]))
                continue
            start, num_fed = seq.start_position, len(seq.token_ids)
            if start < request.num_prompt_tokens:
                self._charge_prompt(request, start, num_fed)
            request.num_computed_tokens += num_fed
            if (start + num_fed) // block_size > start // block_size:
                self.blocks.cache_computed_blocks(request)
            if prompt_logprobs_of and request_id in prompt_logprobs_of:
                self._keep_prompt_logprobs(request, *prompt_logprobs_of[request_id])
            if not seq.needs_sample:
                continue
            sampled_by_tenant = sampled_by_class[request.priority]
            sampled_by_tenant[request.tenant_id] = sampled_by_tenant.get(request.tenant_id, 0) + 1
            token = sampled_tokens[request_id]
            token_ids = request.token_ids
            token_ids.append(token)
            num_output = len(token_ids) - request.num_prompt_tokens
            reason = None
            if token in request.stop_token_ids:
                reason = self._finish(request, RequestStatus.FINISHED_STOPPED)
            elif num_output >= request.max_tokens or len(token_ids) >= max_model_len:
                reason = self._finish(request, RequestStatus.FINISHED_LENGTH)
            logprobs = logprobs_of.get(request_id) if logprobs_of else None
            events.append(new_event(TokenEvent, (
                request.request_id, (token,), reason, request.num_prompt_tokens, num_output, request.num_cached_tokens,
                None, () if logprobs is None else (logprobs,),
                tuple(request.prompt_logprobs) if num_output == 1 else ())))  # the prompt's go with the first token
        for priority, sampled_by_tenant in sampled_by_class.items():
            self.vtc[priority].charge_sampled(sampled_by_tenant)
        if result.proposals:
            self._keep_proposals(result.proposals)
        return events

    def _keep_proposals(self, proposals: Mapping[str, tuple[int, ...]]) -> None:
        assert self.speculator is not None
        for request_id, tokens in proposals.items():
            request = self.requests.get(request_id)  # type: ignore[call-overload]  # a str that is a RequestId
            if request is not None and request.status is RequestStatus.RUNNING:
                self.speculator.keep_model_proposals(request_id, len(request.token_ids), tokens)

    def _take_verified(self, request: Request, seq: ScheduledSequence, result: StepResult,
                       sampled_by_tenant: dict[str, int]) -> TokenEvent:
        """A decode that verified proposals: its accepted tokens and the one after them, up to a stop token or
        its length; the blocks past them go back. The tenant is charged for every token computed for it, the
        rejected proposals too, so that speculating cannot buy more than its share."""
        assert self.speculator is not None
        emitted = result.tokens_of(seq.request_id)
        num_accepted = len(emitted) - 1
        self.speculator.observe(request.request_id, request.tenant_id, seq.num_draft_tokens, num_accepted)
        sampled_by_tenant[request.tenant_id] = sampled_by_tenant.get(request.tenant_id, 0) + len(seq.token_ids)
        kept: list[int] = []
        status = None
        token_ids, max_model_len = request.token_ids, self.geometry.max_model_len
        for token in emitted:
            token_ids.append(token)
            kept.append(token)
            if token in request.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(token_ids) - request.num_prompt_tokens >= request.max_tokens or len(token_ids) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                break
        # The fed token and the accepted proposals kept have their K/V now; the last token kept is computed next.
        request.num_computed_tokens = seq.start_position + len(kept)
        block_size = self.geometry.block_size
        if request.num_computed_tokens // block_size > seq.start_position // block_size:
            self.blocks.cache_computed_blocks(request)
        reason = None if status is None else self._finish(request, status)
        if reason is None:
            self.blocks.trim(request)
        logprobs = result.verified_logprobs.get(seq.request_id, ())[:len(kept)]
        return TokenEvent(request.request_id, tuple(kept), reason, request.num_prompt_tokens,
                          request.num_output_tokens, request.num_cached_tokens, None, logprobs)

    @staticmethod
    def _keep_prompt_logprobs(request: Request, first_position: int, entries: tuple[TokenLogprobs, ...]) -> None:
        """Entry i is for prompt position i + 1. A prompt recomputed after a preemption yields
        entries already kept: only the new tail is added."""
        known = len(request.prompt_logprobs) + 1  # the next position without an entry
        request.prompt_logprobs.extend(entries[max(0, known - first_position):])

    def _charge_prompt(self, request: Request, start: int, num_fed: int) -> None:
        """Charge the tenant's counter w_p for each prompt token computed for the first time (w_q for
        each sampled token is charged in `update`). Work redone after a recompute preemption is not
        charged: the scheduler chose it, not the tenant, and charging it would push the tenant
        preempted most further behind."""
        end = min(start + num_fed, request.num_prompt_tokens)
        first = max(start, request.num_charged_prompt_tokens)
        num_prefill = max(0, end - first)
        request.num_charged_prompt_tokens = max(request.num_charged_prompt_tokens, end)
        num_pinned = max(0, min(end, request.cache_pin_tokens) - first)  # written to a breakpoint's blocks
        self.vtc[request.priority].charge(request.tenant_id, num_prefill, 0, num_pinned_prompt=num_pinned)
        self.fcfs_bound.computed(request, num_prefill)

    def _end_failed_lora_loads(self, failures: tuple[tuple[int, str], ...]) -> list[TokenEvent]:
        """End, with the runner's reason, the running requests whose adapter could not be loaded: their
        tokens of this step came from an empty slot. Everyone else's step stands."""
        events = []
        for slot, why in failures:
            self.lora.empty(slot)
            for request in [r for r in self.running if r.lora_slot == slot]:
                events.append(self._error_event(request, f"the LoRA adapter could not be loaded: {why}"))
        return events

    def _error_event(self, request: Request, message: str) -> TokenEvent:
        self._finish(request, RequestStatus.FINISHED_ERROR)
        event = self._event(request, ())
        return TokenEvent(event.request_id, (), "error", event.num_prompt_tokens, event.num_output_tokens,
                          event.num_cached_tokens, message)

    def fail_all(self, message: str) -> list[TokenEvent]:
        """The executor failed: end every request with an error rather than leave it hanging."""
        return [self._error_event(request, message) for request in list(self.requests.values())]

    def _finish(self, request: Request, status: RequestStatus) -> str | None:
        """End the request with a finished status; its OpenAI finish_reason."""
        if request.status == RequestStatus.WAITING:
            self.waiting[request.priority].remove(request)
        elif request.status == RequestStatus.RUNNING:
            self._stop_running(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.blocks.free(request.request_id)
        request.status = status
        del self.requests[request.request_id]
        self.fcfs_bound.ended(request)
        self.load.finished(request)
        self._finished_ids.append(request.request_id)
        if status == RequestStatus.FINISHED_ABORTED:
            self.counters.num_aborted += 1
        else:
            self.counters.num_finished += 1
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):  # ended by itself
            self.output_lengths.observe(request)
        if self.speculator is not None:
            self.speculator.finished(request.request_id, request.tenant_id, request.output_token_ids)
        return finish_reason(status)

    @staticmethod
    def _event(request: Request, new_tokens: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...] = ()
               ) -> TokenEvent:
        first = new_tokens and request.num_output_tokens == 1  # the prompt's log probabilities go with it
        return TokenEvent(request.request_id, new_tokens, finish_reason(request.status),
                          request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens,
                          logprobs=logprobs, prompt_logprobs=tuple(request.prompt_logprobs) if first else ())

    def calibration_steps(self, lone_decode_only: bool = False) -> Generator[StepPlan, None, None]:
        """Timed steps for the cost model over free blocks (scheduling/calibration.py), one at a time: each
        one's blocks come back when the next is asked for. Run with no step in between."""
        shapes = LONE_DECODE if lone_decode_only else SHAPES
        for plan in calibration_plans(self.blocks, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                      shapes):
            yield plan
            self._finished_ids += [seq.request_id for seq in plan.sequences]  # the runner drops their state

    def observe_calibration(self, plan: StepPlan, seconds: float) -> None:
        self.shaper.cost_model.anchor(work_of(plan), seconds)

    @property
    def lacks_lone_decode(self) -> bool:
        """Whether the cost model has no lone decode's time for the forward serving now."""
        return self.shaper.cost_model.lone_decode_s is None

    def observe_step_time(self, plan: StepPlan, seconds: float) -> None:
        """How long the step of `plan` took, from schedule() to its events: the cost model learns from it."""
        self.shaper.observe(plan, seconds, self.clock())

    # ---- observation ----------------------------------------------------------------------

    def snapshot(self) -> SchedulerSnapshot:
        """The state readers outside may see (see scheduling/snapshot.py); changes nothing."""
        c = self.counters
        return SchedulerSnapshot(
            step=c.num_steps,
            by_class=MappingProxyType({p.value: ClassLoad(self.load.num_running(p), len(self.waiting[p]),
                                                          sum(r.priority is p for r in self.swapped))
                                       for p in CLASSES}),
            queued_by_tenant=MappingProxyType({p.value: MappingProxyType(self.waiting[p].queued_by_tenant())
                                               for p in CLASSES}),
            vtc=MappingProxyType({p.value: MappingProxyType(self.vtc[p].snapshot()) for p in CLASSES}),
            kv_blocks=BlockUse(self.blocks.device.num_used, self.blocks.device.num_blocks),
            cpu_blocks=BlockUse(self.blocks.cpu.num_used, self.blocks.cpu.num_blocks),
            cached_blocks=self.blocks.device.num_cached,
            prefix_queried_tokens=self.blocks.prefix_counters.queried_tokens,
            prefix_hit_tokens=self.blocks.prefix_counters.hit_tokens,
            preemptions=MappingProxyType({mode: c.preemptions[mode] for mode in ("swap", "recompute")}),
            blocks_swapped_out=c.blocks_swapped_out, blocks_swapped_in=c.blocks_swapped_in,
            bytes_per_block=self.geometry.bytes_per_block, num_finished=c.num_finished, num_aborted=c.num_aborted,
            step_cost=self._step_cost_stats(),
            tiers=self._tier_stats(),
            output_length_rank_correlation=self.output_lengths.rank_correlation,
            speculation=self._speculation_stats(),
        )

    def _speculation_stats(self) -> SpeculationStats | None:
        if self.speculator is None:
            return None
        c = self.speculator.counters
        return SpeculationStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                tuple(c.accepted_per_position),
                                MappingProxyType({t: (d, p, a) for t, (d, p, a) in c.by_tenant.items()}))

    def _tier_stats(self) -> Mapping[str, TierStats]:
        tiers = self.blocks.tiers
        if tiers is None:
            return MappingProxyType({})
        return MappingProxyType({
            index.name: TierStats(len(index), index.capacity, index.counters.hits, index.counters.writes,
                                  index.counters.evictions, index.counters.lost)
            for index in (tiers.host, tiers.disk) if index.capacity})

    def _step_cost_stats(self) -> StepCostStats:
        model, counters = self.shaper.cost_model, self.shaper.counters
        coefficients = None if model.coefficients is None else MappingProxyType(
            {f.name: getattr(model.coefficients, f.name) for f in COEFFICIENT_FIELDS})
        return StepCostStats(model.last_predicted_s, model.last_measured_s, model.median_error, coefficients,
                             counters.shaped_steps, counters.batch_tokens_deferred, counters.itl_target_missed_steps,
                             counters.long_prompt_tokens_deferred)


def _date_tenants(seen: dict[str, float], tenants: Iterable[str], now: float,
                  is_recent: Callable[[float], bool]) -> None:
    """Date these tenants now in `seen`, and forget those whose date is no longer recent. A tenant dated
    alone is kept whatever its date: whether it is gone is decided once another tenant comes."""
    for tenant_id in tenants:
        seen[tenant_id] = now
    if len(seen) > 1:
        for tenant_id in [t for t, at in seen.items() if not is_recent(now - at)]:
            del seen[tenant_id]
