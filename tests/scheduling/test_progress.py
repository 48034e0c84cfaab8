"""Every admitted request progresses, and nothing waits behind work that cannot move: the shapes of the
stall a soak of an 85-block pool ran into (issue 30), on the fake executor with a known step cost.

The cost is the one of a CPU, where the cost per token dominates the fixed cost of a step: a derived
shaping target (1.1x the interactive work's predicted time) then leaves a step with no interactive
work in it less time than one batch decode costs.
"""

from __future__ import annotations

import pytest

from benchmarks.fake_executors import FakeExecutor, LinearStepCost
from contract.plan import StepPlan
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.step_shaper import ShapingConfig
from scheduling.tenant_load import TenantLoad
from tenancy.tenants import Tenant, TenantId, TenantLimits, TenantRegistry
from tests.factories import make_request, make_scheduler

BATCH, INTERACTIVE = PriorityClass.BATCH, PriorityClass.INTERACTIVE
BLOCK_SIZE = 16
MAX_STEPS = 2000


# A CPU's costs: 10 ms a step and 2 ms a token, so one batch decode (2 ms) costs more than a tenth of an empty step.
CPU_LIKE_COST = LinearStepCost(overhead_s=0.010, per_token_s=0.002)


class Run:
    """A scheduler stepped by hand the way the engine steps it, its cost model fed the fake's step times."""

    def __init__(self, tenants: TenantRegistry, num_device_blocks: int, num_cpu_blocks: int = 256,
                 shaping: ShapingConfig | None = None) -> None:
        config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, shaping=shaping or ShapingConfig())
        self.scheduler: Scheduler = make_scheduler(config, num_device_blocks=num_device_blocks,
                                                   num_cpu_blocks=num_cpu_blocks, block_size=BLOCK_SIZE,
                                                   tenants=tenants)
        self.executor = FakeExecutor(self.scheduler.geometry, CPU_LIKE_COST)
        self.num_empty_steps = 0  # steps that computed nothing while requests were unfinished

    def submit(self, tenant: str, priority: PriorityClass, prompt: int, max_tokens: int) -> Request:
        request = make_request(prompt, max_tokens, tenant_id=tenant, priority=priority)
        self.scheduler.add_request(request)
        return request

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        if not plan.sequences and self.scheduler.has_work():
            self.num_empty_steps += 1
        self.scheduler.update(plan, self.executor.execute(plan))
        self.scheduler.observe_step_time(plan, self.executor.costs.seconds(plan))
        return plan

    def warm_up(self, tenant: str) -> None:
        """Batch work alone until the cost model has a fit (shaping acts only then)."""
        for _ in range(4):
            self.submit(tenant, BATCH, 64, 24)
        while self.scheduler.has_work():
            self.step()
        assert self.scheduler.shaper.cost_model.coefficients is not None

    def steps_until_finished(self, requests: list[Request]) -> int:
        """Step until every one of `requests` has ended; how many steps that took (at most MAX_STEPS)."""
        for steps in range(MAX_STEPS):
            if all(r.status.is_finished for r in requests):
                return steps
            self.step()
        unfinished = [(r.request_id, r.priority.value, r.status.name, r.num_computed_tokens) for r in requests
                      if not r.status.is_finished]
        raise AssertionError(f"still unfinished after {MAX_STEPS} steps: {unfinished}; "
                             f"{self.num_empty_steps} empty steps")


def two_tenants(**limits: TenantLimits) -> TenantRegistry:
    """alice (weight 2) and bob (weight 1), the soak's tenants."""
    return TenantRegistry([Tenant(TenantId(name), weight, limits=limits.get(name, TenantLimits()))
                           for name, weight in (("alice", 2.0), ("bob", 1.0))], requires_auth=False)


def test_an_interactive_request_is_not_held_back_by_batch_work_of_either_tenant() -> None:
    """bob (share 30 x 1/3 = 10 blocks) runs a batch request of 12 blocks; then bob sends an interactive
    request and alice a batch one. Neither batch request may hold bob's interactive one back: bob's own
    batch blocks give way to it (they are preempted for it if need be), and alice's batch request would
    run only after it anyway. It starts at once, and every request ends with no step left empty."""
    run = Run(two_tenants(), num_device_blocks=30)
    run.warm_up("alice")
    bob_batch = run.submit("bob", BATCH, 12 * BLOCK_SIZE - 8, 64)
    run.step()  # bob's batch request is admitted: its whole prompt in one step
    assert run.scheduler.blocks.device_blocks_held_by("bob") == 12

    bob_chat = run.submit("bob", INTERACTIVE, 2 * BLOCK_SIZE, 16)
    alice_batch = run.submit("alice", BATCH, 8 * BLOCK_SIZE, 16)
    run.step()
    assert bob_chat.num_output_tokens == 1  # its prompt and first token in the step after it arrived
    steps = run.steps_until_finished([bob_chat, bob_batch, alice_batch])

    assert run.num_empty_steps == 0
    assert steps < 200, steps


@pytest.mark.parametrize("shaping", [
    ShapingConfig(),  # derived: 1.1x an empty step's fixed cost leaves batch less than one decode
    ShapingConfig(interactive_itl_target_s=0.005),  # fixed, below the fixed cost of any step: no time at all
], ids=["derived-target", "unmeetable-fixed-target"])
def test_an_interactive_request_at_its_tenants_max_concurrent_neither_waits_nor_freezes_its_batch_work(
        shaping: ShapingConfig) -> None:
    """bob may run one request at a time and runs a batch one; his interactive request does not wait for
    that one to end: the batch request gives way (scheduling/interactive_room.py), and resumes once the
    interactive one has ended. Under either target, shaping holds neither back and no step is empty."""
    run = Run(two_tenants(bob=TenantLimits(max_concurrent=1)), num_device_blocks=64, shaping=shaping)
    run.warm_up("alice")
    bob_batch = run.submit("bob", BATCH, 4 * BLOCK_SIZE, 64)
    run.step()
    bob_chat = run.submit("bob", INTERACTIVE, 2 * BLOCK_SIZE, 16)
    run.step()
    assert bob_chat.status is RequestStatus.RUNNING and bob_batch.num_preemptions == 1  # started at once
    steps = run.steps_until_finished([bob_chat, bob_batch])

    assert run.num_empty_steps == 0
    assert steps < 200, steps


def test_the_interactive_kv_share_is_split_among_the_tenants_with_interactive_requests() -> None:
    """The share of an interactive request counts the tenants with interactive requests; that of a batch
    request, every tenant with an unfinished request."""
    load = TenantLoad(two_tenants())
    alice_batch, bob_chat = make_request(tenant_id="alice", priority=BATCH), make_request(tenant_id="bob")
    alice_chat = make_request(tenant_id="alice")
    load.added(alice_batch)
    load.added(bob_chat)
    assert (load.active_weight_from(INTERACTIVE), load.active_weight_from(BATCH)) == (1.0, 3.0)
    load.added(alice_chat)
    assert (load.active_weight_from(INTERACTIVE), load.active_weight_from(BATCH)) == (3.0, 3.0)
    load.finished(bob_chat)
    load.finished(alice_chat)
    assert (load.active_weight_from(INTERACTIVE), load.active_weight_from(BATCH)) == (0.0, 2.0)
    load.finished(alice_batch)
    assert (load.active_weight_from(INTERACTIVE), load.active_weight_from(BATCH)) == (0.0, 0.0)
