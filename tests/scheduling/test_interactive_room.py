"""Interactive requests never wait on batch work for a LoRA slot or for their tenant's max_concurrent
(issue 30). Running batch requests give that room up for them as they give up KV blocks, batch work does
not take the room back while they wait for it, and every batch request still ends with its whole output.

Driven by hand through `schedule()` / `update()` on the fake executor, whose tokens are a pure function
of request and position: a preempted request's output is checked token by token.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.fake_executors import FakeExecutor
from contract.plan import BASE_MODEL_SLOT, CacheGeometry, LoraRef, StepPlan
from scheduling.prefix_cache import prompt_block_hashes
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantLimits, TenantRegistry
from tests.factories import make_geometry, make_request, prompt_tokens

BATCH, INTERACTIVE = PriorityClass.BATCH, PriorityClass.INTERACTIVE
A, B, C = (LoraRef(name, f"/adapters/{name}", 1) for name in ("a", "b", "c"))
BLOCK_SIZE = 4
MAX_STEPS = 1000


def limited(**max_concurrent: int) -> TenantRegistry:
    """Tenants with these max_concurrent limits (any other tenant id gets an unlimited stand-in)."""
    return TenantRegistry([Tenant(TenantId(name), limits=TenantLimits(max_concurrent=limit))
                           for name, limit in max_concurrent.items()], requires_auth=False)


class Run:
    """A scheduler stepped by hand, every request it was given, and checks made at every step."""

    def __init__(self, *, max_loras: int = 0, tenants: TenantRegistry | None = None, mode: str = "swap",
                 max_num_seqs: int = 16, geometry: CacheGeometry | None = None) -> None:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_loras=max_loras,
                                 preemption_mode=mode)
        self.scheduler = Scheduler(config, geometry or make_geometry(256, 256, BLOCK_SIZE), tenants)
        self.executor = FakeExecutor(self.scheduler.geometry)
        self.requests: dict[str, Request] = {}
        self.most_running: dict[str, int] = {}  # per tenant: the most requests it ran in one step

    def submit(self, priority: PriorityClass, tenant: str, adapter: LoraRef | None = None, max_tokens: int = 6,
               prompt: list[int] | int = 8, cache_salt: str = "") -> Request:
        request = make_request(prompt, max_tokens, tenant_id=tenant, priority=priority)
        request.adapter, request.cache_salt = adapter, cache_salt
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        return request

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        resident = self.scheduler.lora.resident()  # once the plan's loads are made
        running_of: dict[str, int] = {}
        for seq in plan.sequences:
            request = self.requests[seq.request_id]
            if seq.lora_slot != BASE_MODEL_SLOT:  # no load overwrote the adapter of a sequence the step runs
                assert resident[seq.lora_slot] == request.adapter, (seq.request_id, resident)
            running_of[request.tenant_id] = running_of.get(request.tenant_id, 0) + 1
        for tenant, count in running_of.items():
            self.most_running[tenant] = max(count, self.most_running.get(tenant, 0))
        self.scheduler.update(plan, self.executor.execute(plan))
        return plan

    def steps_until(self, condition: Callable[[], bool], limit: int, between: Callable[[], object] = lambda: None
                    ) -> int:
        """Step until the condition holds, calling `between` after each step; how many steps it took."""
        for steps in range(limit + 1):
            if condition():
                return steps
            self.step()
            between()
        raise AssertionError(f"not within {limit} steps; preemptions: {self.victims()}")

    def victims(self) -> list[str]:
        return [event.victim_id for event in self.scheduler.preemption_log]

    def finish(self) -> None:
        """Step until no work is left; then every request has its whole output and nothing is held."""
        self.steps_until(lambda: not self.scheduler.has_work(), MAX_STEPS)
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED_LENGTH, request.request_id
            assert request.output_token_ids == [
                self.executor.token_for(request.request_id, request.num_prompt_tokens + k)
                for k in range(request.max_tokens)], request.request_id
        blocks, lora = self.scheduler.blocks, self.scheduler.lora
        assert blocks.device.num_free == blocks.device.num_blocks and blocks.cpu.num_free == blocks.cpu.num_blocks
        assert all(lora.num_pins(slot) == 0 for slot in range(lora.num_slots))
        assert all(e.victim_class is BATCH and e.for_class is INTERACTIVE for e in self.scheduler.preemption_log)


# ---- LoRA slots ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_interactive_request_preempts_the_batch_requests_pinning_the_only_lora_slot(mode: str) -> None:
    """One slot, pinned by batch requests of adapter A while more of them keep arriving, one a step: an
    interactive request of adapter B gets its first token in the step after it arrives, not after the
    flow of batch work dries up."""
    run = Run(max_loras=1, mode=mode)
    batch = [run.submit(BATCH, "b", A)]

    def one_more_batch_request() -> None:
        batch.append(run.submit(BATCH, "b", A))

    run.steps_until(lambda: len(batch) == 5, 10, one_more_batch_request)
    chat = run.submit(INTERACTIVE, "i", B, max_tokens=4)
    assert run.steps_until(lambda: chat.num_output_tokens > 0, 1, one_more_batch_request) == 1
    run.steps_until(lambda: len(batch) == 30, 30, one_more_batch_request)  # the flow goes on
    run.finish()

    assert set(run.victims()) <= {r.request_id for r in batch} and run.victims()
    assert all(request.num_preemptions <= 1 for request in batch)  # given way once, not at every step


def test_the_slot_pinned_by_the_fewest_batch_requests_is_freed() -> None:
    run = Run(max_loras=2)
    on_a = [run.submit(BATCH, "b", A, max_tokens=20) for _ in range(3)]
    on_c = run.submit(BATCH, "b", C, max_tokens=20)
    run.step()
    chat = run.submit(INTERACTIVE, "i", B, max_tokens=4)
    run.step()
    assert chat.num_output_tokens == 1
    assert run.victims() == [on_c.request_id]  # one request gives way, not three
    assert all(r.status is RequestStatus.RUNNING for r in on_a)
    run.finish()


def test_a_slot_pinned_by_an_interactive_request_is_never_freed() -> None:
    """The only slot holds A, pinned by an interactive request and a batch one: an interactive request
    of B waits for the interactive one (equals wait for each other), and nobody is preempted for nothing.
    Once the slot is the batch request's alone, that one gives way."""
    run = Run(max_loras=1)
    first_chat = run.submit(INTERACTIVE, "i", A, max_tokens=8)
    batch = run.submit(BATCH, "b", A, max_tokens=40)
    run.step()
    second_chat = run.submit(INTERACTIVE, "j", B, max_tokens=4)
    run.steps_until(lambda: first_chat.status.is_finished, 10)
    assert not run.victims() and second_chat.status is RequestStatus.WAITING
    run.steps_until(lambda: second_chat.num_output_tokens > 0, 1)
    assert run.victims() == [batch.request_id]
    run.finish()


# ---- a tenant's max_concurrent ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_interactive_request_preempts_its_tenants_own_batch_request_at_max_concurrent(mode: str) -> None:
    """bob may run one request at a time and runs a batch one: his interactive request takes its place in
    the next step. alice's batch request is not his to give up. bob's batch request waits while his
    interactive one runs (its room is not taken back), then resumes and ends."""
    run = Run(tenants=limited(bob=1), mode=mode)
    alice_batch = run.submit(BATCH, "alice", max_tokens=60)
    bob_batch = run.submit(BATCH, "bob", max_tokens=40)
    run.steps_until(lambda: bob_batch.num_output_tokens >= 3, 10)
    bob_chat = run.submit(INTERACTIVE, "bob", max_tokens=6)
    assert run.steps_until(lambda: bob_chat.num_output_tokens > 0, 1) == 1
    run.steps_until(lambda: bob_chat.status.is_finished, 10)
    run.finish()

    assert run.victims() == [bob_batch.request_id] and alice_batch.num_preemptions == 0
    assert run.most_running["bob"] == 1


def test_only_the_room_that_can_be_made_is_made() -> None:
    """bob may run two requests and runs an interactive one and a batch one; two more interactive ones
    arrive. Only one of them can start (his batch request gives way, his interactive one does not), so
    only his batch request is preempted: with max_num_seqs=3, making room for both would take alice's
    batch request too, for a request that could not start."""
    run = Run(tenants=limited(bob=2), max_num_seqs=3)
    alice_batch = run.submit(BATCH, "alice", max_tokens=40)
    bob_chat = run.submit(INTERACTIVE, "bob", max_tokens=10)
    bob_batch = run.submit(BATCH, "bob", max_tokens=40)
    run.step()
    later_chats = [run.submit(INTERACTIVE, "bob", max_tokens=4) for _ in range(2)]
    run.step()
    assert [c.num_output_tokens for c in later_chats] == [1, 0]
    run.steps_until(lambda: bob_chat.status.is_finished, 10)
    assert run.victims() == [bob_batch.request_id] and alice_batch.status is RequestStatus.RUNNING
    run.finish()
    assert run.most_running["bob"] == 2 and alice_batch.num_preemptions == 0


# ---- the room made stays the interactive request's -------------------------------------------------


@pytest.mark.parametrize("limit", ["lora_slot", "max_concurrent"])
def test_batch_work_does_not_take_the_room_a_waiting_interactive_request_needs(limit: str) -> None:
    """An interactive request whose prefix is on disk waits one step for its read. Meanwhile a batch request
    that would take the LoRA slot (or its tenant's one concurrent request) it needs waits too, instead of
    running one step and being preempted in the next."""
    chat_prompt, salt = prompt_tokens(16, salt=7), "chat"
    geometry = CacheGeometry(256, 256, BLOCK_SIZE, 1024, 1024, num_host_blocks=16, num_disk_blocks=64,
                             disk_block_hashes=prompt_block_hashes(chat_prompt, BLOCK_SIZE, salt))
    lora = limit == "lora_slot"
    run = Run(max_loras=1, tenants=limited(bob=1), geometry=geometry)
    batch_tenant, chat_tenant = ("alice", "carol") if lora else ("bob", "bob")
    adapters = (A, B) if lora else (None, None)
    first = run.submit(BATCH, batch_tenant, adapters[0], max_tokens=2)
    run.steps_until(lambda: first.status.is_finished, 5)  # the slot is free now, A still in it

    chat = run.submit(INTERACTIVE, chat_tenant, adapters[1], max_tokens=4, prompt=chat_prompt, cache_salt=salt)
    later = run.submit(BATCH, batch_tenant, adapters[0], max_tokens=4)
    run.step()
    assert chat.status is RequestStatus.WAITING  # its blocks are being read from disk
    assert later.status is RequestStatus.WAITING
    run.step()
    assert chat.num_output_tokens == 1 and chat.num_cached_tokens > 0
    run.finish()
    assert not run.victims()
