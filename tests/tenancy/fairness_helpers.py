"""Drive the real scheduler over a FakeExecutor in virtual time and measure what each tenant received.

`FairnessSim` runs the engine's loop by hand (schedule, execute, update) with no asyncio and no real
time: the executor's clock is the only clock. Service is measured from the plans themselves, not from
the scheduler's counters: `w_p` per prompt token computed plus `w_q` per generated token, unweighted.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from benchmarks.fake_executors import FakeExecutor, TokenCosts
from contract.plan import CacheGeometry, StepPlan
from scheduling.request import PriorityClass, Request, RequestId
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantLimits, TenantRegistry
from tenancy.vtc import ServiceWeights

INTERACTIVE = PriorityClass.INTERACTIVE
BATCH = PriorityClass.BATCH


def make_registry(weights: Mapping[str, float], limits: Mapping[str, TenantLimits] | None = None) -> TenantRegistry:
    """Tenants with these weights (and optional limits); no keys, no authentication."""
    limits = limits or {}
    return TenantRegistry([Tenant(TenantId(t), w, limits=limits.get(t, TenantLimits())) for t, w in weights.items()],
                          requires_auth=False)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one value has everything."""
    xs = list(values)
    total_sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * total_sq) if total_sq else 1.0


def vtc_bound(weights: ServiceWeights, longest_prompt: int, max_step_tokens: int) -> float:
    """VTC's fairness bound 2 * max(w_p * L_input, w_q * M) (OSDI 2024, Theorem 4.4)."""
    return 2 * max(weights.prompt * longest_prompt, weights.decode * max_step_tokens)


@dataclass(slots=True)
class StepRecord:
    plan: StepPlan
    start: float  # virtual clock before the step
    end: float  # virtual clock after it
    service: dict[tuple[PriorityClass, str], float]  # unweighted service per (class, tenant) this step
    running: Counter[str]  # running requests per tenant once the step was scheduled


@dataclass(slots=True)
class FairnessSim:
    scheduler: Scheduler
    executor: FakeExecutor
    requests: dict[RequestId, Request] = field(default_factory=dict)
    service: defaultdict[tuple[PriorityClass, str], float] = field(  # running totals
        default_factory=lambda: defaultdict(float))
    first_scheduled: dict[RequestId, float] = field(default_factory=dict)  # virtual start of its first step
    prompt_done: dict[RequestId, int] = field(default_factory=dict)  # prompt tokens computed at least once
    finished: set[RequestId] = field(default_factory=set)
    history: list[StepRecord] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)
    _submitted: Counter[str] = field(default_factory=Counter)  # requests keep_backlogged made, per tenant

    @property
    def clock(self) -> float:
        return self.executor.clock

    @property
    def weights(self) -> ServiceWeights:
        return self.scheduler.config.service_weights

    def submit(self, tenant: str, prompt_len: int, max_tokens: int, priority: PriorityClass = INTERACTIVE,
               arrival_time: float | None = None) -> Request:
        number = next(self._numbers)
        request = Request(RequestId(f"{tenant}-{number}"), [(number * 7 + i) % 256 for i in range(prompt_len)],
                          max_tokens, tenant_id=TenantId(tenant), priority=priority,
                          arrival_time=self.clock if arrival_time is None else arrival_time)
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    def num_waiting(self, tenant: str, priority: PriorityClass = INTERACTIVE) -> int:
        return sum(r.tenant_id == tenant for r in self.scheduler.waiting[priority])

    def keep_backlogged(self, tenants: Iterable[str], prompt_len: int | Sequence[int], max_tokens: int | Sequence[int],
                        priority: PriorityClass = INTERACTIVE, depth: int = 2) -> None:
        """Top each tenant's waiting line up to `depth` requests; every tenant cycles through the same
        (prompt, output) shapes in the same order."""
        prompts = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
        outputs = [max_tokens] if isinstance(max_tokens, int) else list(max_tokens)
        for tenant in tenants:
            for _ in range(depth - self.num_waiting(tenant, priority)):
                n = self._submitted[tenant]
                self._submitted[tenant] += 1
                self.submit(tenant, prompts[n % len(prompts)], outputs[(n // len(prompts)) % len(outputs)], priority)

    def step(self) -> StepRecord:
        plan = self.scheduler.schedule()
        running = Counter[str](r.tenant_id for r in self.scheduler.running)
        start = self.clock
        service: dict[tuple[PriorityClass, str], float] = defaultdict(float)
        for seq in plan.sequences:
            request = self.requests[RequestId(seq.request_id)]
            self.first_scheduled.setdefault(request.request_id, start)
            # Service is useful work: a prompt token counts the first time it is computed, not again
            # when a recompute preemption makes the scheduler redo it.
            prompt_end = min(seq.start_position + len(seq.token_ids), request.num_prompt_tokens)
            done_before = self.prompt_done.get(request.request_id, 0)
            prompt_computed = max(0, prompt_end - max(seq.start_position, done_before))
            self.prompt_done[request.request_id] = max(done_before, prompt_end)
            cost = self.weights.prompt * prompt_computed + self.weights.decode * seq.needs_sample
            service[(request.priority, request.tenant_id)] += cost
        result = self.executor.execute(plan)
        for event in self.scheduler.update(plan, result):
            if event.is_final:
                self.finished.add(event.request_id)
        for key, amount in service.items():
            self.service[key] += amount
        record = StepRecord(plan, start, self.clock, dict(service), running)
        self.history.append(record)
        return record

    def weighted_service(self, tenant: str, priority: PriorityClass = INTERACTIVE) -> float:
        return self.service[(priority, tenant)] / self.scheduler.tenants.weight(tenant)

    def queueing_delays(self, tenant: str) -> list[float]:
        """Virtual seconds from arrival to first being scheduled, for this tenant's scheduled requests."""
        return [self.first_scheduled[r.request_id] - r.arrival_time for r in self.requests.values()
                if r.tenant_id == tenant and r.request_id in self.first_scheduled]


def make_sim(weights: Mapping[str, float], *, limits: Mapping[str, TenantLimits] | None = None,
             max_num_seqs: int = 16, max_num_batched_tokens: int = 128, num_device_blocks: int = 256,
             block_size: int = 4, queue_policy: str = "vtc", kv_share_limit: bool = True,
             costs: TokenCosts | None = None) -> FairnessSim:
    """A scheduler over these tenants and a FakeExecutor on its geometry."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             queue_policy=queue_policy, kv_share_limit=kv_share_limit)
    geometry = CacheGeometry(num_device_blocks, 0, block_size, 1024, 4096)
    executor = FakeExecutor(geometry, costs or TokenCosts(prefill_token=0.0001, decode_token=0.0, step=0.01))
    return FairnessSim(Scheduler(config, geometry, make_registry(weights, limits)), executor)
