"""Weighted fair queueing across tenants (VTC), through the real scheduler and a fake executor.

Every test drives `Scheduler.schedule()` / `update()` by hand in virtual time (tests/tenancy/
fairness_helpers.py). Service is what the plans computed: `w_p` per prompt token plus `w_q` per
generated token, unweighted; "weighted service" divides it by the tenant's weight.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Container

import pytest

from benchmarks.fake_executors import TokenCosts
from scheduling.queue import FCFSQueue, VTCQueue
from scheduling.request import Request, RequestId
from tenancy.tenants import TenantId, TenantLimits
from tenancy.vtc import ServiceWeights, VirtualTokenCounter
from tests.tenancy.fairness_helpers import BATCH, INTERACTIVE, FairnessSim, jain_index, make_sim, vtc_bound

PROMPTS = (16, 40, 64)  # every tenant cycles through the same request shapes
OUTPUTS = (8, 24, 48)
LONGEST_PROMPT = max(PROMPTS)


def run_backlogged(sim: FairnessSim, tenants: list[str], num_steps: int) -> None:
    for _ in range(num_steps):
        sim.keep_backlogged(tenants, PROMPTS, OUTPUTS)
        sim.step()


def bound_of(sim: FairnessSim) -> float:
    return vtc_bound(sim.weights, LONGEST_PROMPT, sim.scheduler.config.max_num_batched_tokens)


# ---- shares ----------------------------------------------------------------------------------


def test_weighted_tenants_get_service_in_proportion_to_weight() -> None:
    """Weights 1:2:1, all backlogged: each share within 5% (relative) of 25/50/25 over a window
    that starts once the pipeline is full. Memory is tight enough that requests get preempted."""
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    sim = make_sim(weights, num_device_blocks=256)
    run_backlogged(sim, list(weights), 200)
    before = {t: sim.service[(INTERACTIVE, t)] for t in weights}
    run_backlogged(sim, list(weights), 1200)
    window = {t: sim.service[(INTERACTIVE, t)] - before[t] for t in weights}
    total = sum(window.values())
    for tenant, weight in weights.items():
        target = weight / sum(weights.values())
        assert window[tenant] / total == pytest.approx(target, rel=0.05), (tenant, window)
    assert sim.scheduler.counters.preemptions["recompute"] > 0


@pytest.mark.parametrize(("policy", "depths", "is_fair"), [
    ("vtc", (1, 1, 1, 8), True),
    ("fcfs", (1, 1, 1, 8), False),  # the same load without VTC: the deepest queue wins
])
def test_equal_weights_give_jain_index_near_one(policy: str, depths: tuple[int, ...], is_fair: bool) -> None:
    """Four equally weighted backlogged tenants, one of them keeping 8 requests queued instead of 1.
    Under VTC their service has Jain's index >= 0.99."""
    tenants = ["a", "b", "c", "d"]
    sim = make_sim(dict.fromkeys(tenants, 1.0), queue_policy=policy, kv_share_limit=False, num_device_blocks=1024)
    for _ in range(800):
        for tenant, depth in zip(tenants, depths, strict=True):
            sim.keep_backlogged([tenant], PROMPTS, OUTPUTS, depth=depth)
        sim.step()
    index = jain_index(sim.weighted_service(t) for t in tenants)
    assert (index >= 0.99) is is_fair, index


# ---- VTC's bound -----------------------------------------------------------------------------


@pytest.mark.parametrize(("kv_share_limit", "num_device_blocks"), [
    (True, 1024),  # the default rules with memory to spare
    (False, 256),  # memory so tight that requests are preempted and recomputed
    (True, 256),  # the same, with the KV share rule passing over the smallest counter at times
])
def test_service_gap_stays_within_vtc_bound_every_step(kv_share_limit: bool, num_device_blocks: int) -> None:
    """Two backlogged tenants of weights 1 and 2: after every step, the gap between their weighted
    services is at most 2 * max(w_p * L_input, w_q * M), with L_input the longest prompt and M the most
    tokens in one step (max_num_batched_tokens). Service is useful work: prompt tokens a recompute
    preemption makes the scheduler compute again are charged to nobody."""
    weights = {"a": 1.0, "b": 2.0}
    sim = make_sim(weights, kv_share_limit=kv_share_limit, num_device_blocks=num_device_blocks)
    bound = bound_of(sim)
    largest_gap = 0.0
    for _ in range(1500):
        sim.keep_backlogged(list(weights), PROMPTS, OUTPUTS)
        sim.step()
        gap = abs(sim.weighted_service("a") - sim.weighted_service("b"))
        assert gap <= bound, (len(sim.history), gap, bound)
        largest_gap = max(largest_gap, gap)
    assert largest_gap > 0
    assert (sim.scheduler.counters.preemptions["recompute"] > 0) is (num_device_blocks == 256)


def test_tenant_back_from_idle_gets_no_burst() -> None:
    """c sits idle while a and b are served for 500 steps. On return its counter is lifted to the
    smallest backlogged counter, so from then on it never gets ahead of a or b by more than the bound."""
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    sim = make_sim(weights, num_device_blocks=1024)
    run_backlogged(sim, ["a", "b"], 500)
    vtc = sim.scheduler.vtc[INTERACTIVE]
    assert vtc.get("c") == 0.0
    before = {t: sim.weighted_service(t) for t in weights}
    smallest_backlogged = min(vtc.get("a"), vtc.get("b"))
    sim.keep_backlogged(["c"], PROMPTS, OUTPUTS)
    assert vtc.get("c") == smallest_backlogged > 0
    bound = bound_of(sim)
    for _ in range(500):
        sim.keep_backlogged(list(weights), PROMPTS, OUTPUTS)
        sim.step()
        gained = {t: sim.weighted_service(t) - before[t] for t in weights}
        assert gained["c"] - min(gained["a"], gained["b"]) <= bound, gained
    assert gained["c"] > 0


def test_idle_time_is_not_banked_across_a_quiet_moment() -> None:
    """a is served alone, then the class runs dry; when c and a then arrive together, c's long idle
    spell earns it no head start: their gap stays within the bound from the first step on."""
    weights = {"a": 1.0, "c": 1.0}
    sim = make_sim(weights, num_device_blocks=1024)
    run_backlogged(sim, ["a"], 300)
    while sim.scheduler.has_work():
        sim.step()
    before = {t: sim.weighted_service(t) for t in weights}
    bound = bound_of(sim)
    vtc = sim.scheduler.vtc[INTERACTIVE]
    sim.keep_backlogged(["c", "a"], PROMPTS, OUTPUTS)
    assert vtc.get("c") == vtc.get("a") > 0  # c was lifted to how far service had got
    for _ in range(300):
        sim.keep_backlogged(["c", "a"], PROMPTS, OUTPUTS)
        sim.step()
        gained = {t: sim.weighted_service(t) - before[t] for t in weights}
        assert abs(gained["c"] - gained["a"]) <= bound, gained


# ---- a heavy tenant and light ones -------------------------------------------------------------

FULL_STEP_TOKENS = 128
COSTS = TokenCosts(prefill_token=0.0001, decode_token=0.0001, step=0.01)
FULL_STEP_SECONDS = COSTS.step + FULL_STEP_TOKENS * COSTS.prefill_token


def replay_poisson(policy: str, rates: dict[str, float], duration: float, *, kv_share_limit: bool = True
                   ) -> FairnessSim:
    """Seeded Poisson arrivals per tenant, replayed in virtual time until `duration`."""
    rng = random.Random(7)
    arrivals: list[tuple[float, str, int, int]] = []
    for tenant, rate in rates.items():
        moment = rng.expovariate(rate)
        while moment < duration:
            arrivals.append((moment, tenant, rng.choice(PROMPTS), rng.choice(OUTPUTS)))
            moment += rng.expovariate(rate)
    arrivals.sort()
    sim = make_sim(dict.fromkeys(rates, 1.0), queue_policy=policy, kv_share_limit=kv_share_limit,
                   num_device_blocks=512, max_num_batched_tokens=FULL_STEP_TOKENS, costs=COSTS)
    upcoming = iter(arrivals)
    pending = next(upcoming, None)
    while sim.clock < duration:
        while pending is not None and pending[0] <= sim.clock:
            sim.submit(pending[1], pending[2], pending[3], arrival_time=pending[0])
            pending = next(upcoming, None)
        if sim.scheduler.has_work():
            sim.step()
        elif pending is not None:
            sim.executor.clock = pending[0]  # idle until the next arrival
        else:
            break
    return sim


def mean_light_delay(sim: FairnessSim) -> float:
    return statistics.mean(sim.queueing_delays("l1") + sim.queueing_delays("l2"))


@pytest.mark.parametrize(("policy", "kv_share_limit", "within_bound"), [
    ("vtc", True, True),
    ("vtc", False, True),
    ("fcfs", False, False),  # first come, first served queues the light tenants behind the heavy one
])
def test_heavy_tenant_leaves_light_tenants_queueing_delay_bounded(policy: str, kv_share_limit: bool,
                                                                   within_bound: bool) -> None:
    """A heavy tenant sends 10x the requests of each of two light ones and alone overloads the server.
    The bound: the light tenants' mean queueing delay (arrival to first scheduled, virtual seconds)
    stays under 4 full-step costs, 4 * (step overhead + max_num_batched_tokens * per-token cost).
    A light arrival is lifted only to the smallest backlogged counter, so it is next in line: it waits
    for the step in progress and for a sequence slot, not for the heavy tenant's backlog."""
    light_only = replay_poisson(policy, {"l1": 5.0, "l2": 5.0}, duration=5.0, kv_share_limit=kv_share_limit)
    with_heavy = replay_poisson(policy, {"h": 50.0, "l1": 5.0, "l2": 5.0}, duration=5.0,
                                kv_share_limit=kv_share_limit)
    heavy_delays = with_heavy.queueing_delays("h")
    assert statistics.mean(heavy_delays) > 10 * FULL_STEP_SECONDS  # the heavy tenant really is backlogged
    assert mean_light_delay(light_only) < FULL_STEP_SECONDS
    assert (mean_light_delay(with_heavy) <= 4 * FULL_STEP_SECONDS) is within_bound, mean_light_delay(with_heavy)


# ---- classes ---------------------------------------------------------------------------------


def test_interactive_and_batch_keep_separate_counters() -> None:
    """a's interactive service is not held against it in the batch class: there, a and b split the
    service evenly although a has had far more interactive service than b."""
    sim = make_sim({"a": 1.0, "b": 1.0}, num_device_blocks=1024)
    run_backlogged(sim, ["a"], 200)
    while sim.scheduler.has_work():
        sim.step()
    vtc = sim.scheduler.vtc
    assert vtc[INTERACTIVE].get("a") > 0 and vtc[BATCH].get("a") == 0.0
    for _ in range(400):
        sim.keep_backlogged(["a", "b"], PROMPTS, OUTPUTS, priority=BATCH)
        sim.step()
    assert vtc[INTERACTIVE].get("b") == 0.0
    assert jain_index([sim.weighted_service("a", BATCH), sim.weighted_service("b", BATCH)]) >= 0.99
    assert abs(sim.weighted_service("a", BATCH) - sim.weighted_service("b", BATCH)) <= bound_of(sim)


def test_batch_waits_while_interactive_is_backlogged() -> None:
    """Selection is per class: a tenant with the smallest batch counter still waits for interactive work."""
    sim = make_sim({"a": 1.0, "b": 1.0}, max_num_seqs=4, num_device_blocks=1024)
    sim.submit("a", 16, 8, priority=BATCH)
    for _ in range(50):
        sim.keep_backlogged(["b"], PROMPTS, OUTPUTS, depth=4)
        sim.step()
    assert sim.service[(BATCH, "a")] == 0
    assert sim.service[(INTERACTIVE, "b")] > 0


# ---- VTCQueue --------------------------------------------------------------------------------


class CountingCounter(VirtualTokenCounter):
    """Counts how often the queue reads a counter."""

    def __init__(self) -> None:
        super().__init__(ServiceWeights(), lambda tenant: 1.0)
        self.num_reads = 0

    def get(self, tenant_id: str) -> float:
        self.num_reads += 1
        return super().get(tenant_id)


def queued(tenant: str, name: str) -> Request:
    return Request(RequestId(name), [1, 2, 3], 4, tenant_id=TenantId(tenant))


def names(queue: VTCQueue, exclude: Container[str] = ()) -> str | None:
    head = queue.peek(exclude)
    return head.request_id if head else None


def test_vtc_queue_serves_the_smallest_counter_first_and_fifo_within_a_tenant() -> None:
    counter = VirtualTokenCounter(ServiceWeights(), lambda tenant: 1.0)
    queue = VTCQueue(counter)
    assert queue.peek() is None and len(queue) == 0
    a1, a2, b1 = queued("a", "a1"), queued("a", "a2"), queued("b", "b1")
    for request in (a1, a2, b1):
        queue.add(request)
    assert len(queue) == 3 and list(queue) == [a1, a2, b1]
    assert names(queue) == "a1"  # equal counters: the tenant seen first
    counter.charge("a", 10, 0)
    assert names(queue) == "b1"  # a's counter grew since its heap entry was made
    counter.charge("b", 20, 0)
    assert names(queue) == "a1"
    queue.remove(a1)
    assert names(queue) == "a2"
    queue.remove(a2)
    assert names(queue) == "b1"  # a's line is empty: b goes next although its counter is larger
    queue.remove(b1)
    assert queue.peek() is None and len(queue) == 0


def test_vtc_queue_exclude_passes_over_tenants_without_losing_order() -> None:
    counter = VirtualTokenCounter(ServiceWeights(), lambda tenant: 1.0)
    queue = VTCQueue(counter)
    for name, tenant in (("a1", "a"), ("b1", "b"), ("c1", "c")):
        queue.add(queued(tenant, name))
    counter.charge("b", 5, 0)
    counter.charge("c", 9, 0)
    assert names(queue, exclude={"a"}) == "b1"
    assert names(queue, exclude={"a", "b"}) == "c1"
    assert names(queue, exclude={"a", "b", "c"}) is None
    assert names(queue) == "a1"  # the passed-over tenants keep their places
    assert queue.queued_by_tenant() == {"a": 1, "b": 1, "c": 1}


def test_vtc_queue_pass_sets_excluded_tenants_aside_once_and_puts_them_back() -> None:
    """Inside passing_over, a growing exclude gives the same heads as outside, an excluded tenant is
    not read again on later peeks of the pass, and every tenant is back in order once it ends."""
    counter = CountingCounter()
    queue = VTCQueue(counter)
    tenants = [f"t{i}" for i in range(20)]
    for index, tenant in enumerate(tenants):
        queue.add(queued(tenant, f"{tenant}-1"))
        counter.charge(tenant, index, 0)  # t0 first, then t1, ...
    expected = [names(queue, exclude=set(tenants[:k])) for k in range(len(tenants) + 1)]
    excluded: set[str] = set()
    with queue.passing_over():
        heads = [names(queue, excluded)]
        for tenant in tenants:
            excluded.add(tenant)
            counter.num_reads = 0
            heads.append(names(queue, excluded))
            assert counter.num_reads <= 4  # the tenants set aside earlier are not read again
    assert heads == expected == [*(f"{t}-1" for t in tenants), None]
    assert names(queue) == "t0-1" and queue.queued_by_tenant() == {t: 1 for t in tenants}


def test_vtc_queue_prepend_puts_a_request_at_the_head_of_its_tenants_line() -> None:
    counter = VirtualTokenCounter(ServiceWeights(), lambda tenant: 1.0)
    queue = VTCQueue(counter)
    a1, a2, back = queued("a", "a1"), queued("a", "a2"), queued("a", "preempted")
    queue.add(a1)
    queue.add(a2)
    queue.prepend(back)
    assert [r.request_id for r in queue] == ["preempted", "a1", "a2"]
    assert names(queue) == "preempted"
    queue.remove(a1)  # from the middle of the line
    assert [r.request_id for r in queue] == ["preempted", "a2"] and len(queue) == 2
    empty_then_prepended = VTCQueue(counter)
    empty_then_prepended.prepend(queued("b", "b-back"))
    assert names(empty_then_prepended) == "b-back"


def test_vtc_queue_peek_cost_does_not_grow_with_requests_served() -> None:
    """One tenant whose line empties and refills over and over (a quiet server): a peek still reads
    the counter a handful of times, not once per request the tenant ever sent."""
    counter = CountingCounter()
    queue = VTCQueue(counter)
    for number in range(500):
        request = queued("a", f"a{number}")
        queue.add(request)
        assert queue.peek() is request
        queue.remove(request)
        counter.charge("a", 1, 0)
    queue.add(queued("a", "last"))
    counter.num_reads = 0
    assert names(queue) == "last"
    assert counter.num_reads <= 4


def test_fcfs_queue_is_arrival_order_across_tenants() -> None:
    queue = FCFSQueue()
    a1, b1, a2 = queued("a", "a1"), queued("b", "b1"), queued("a", "a2")
    for request in (a1, b1, a2):
        queue.add(request)
    assert queue.peek() is a1
    assert queue.peek(exclude={"a"}) is b1
    queue.prepend(queued("b", "b0"))
    assert [r.request_id for r in queue] == ["b0", "a1", "b1", "a2"]


# ---- the KV share rule and max_concurrent ----------------------------------------------------


def held_blocks(sim: FairnessSim, tenant: str) -> int:
    blocks = sim.scheduler.blocks
    return sum(blocks.num_device_blocks(r.request_id) for r in sim.scheduler.running if r.tenant_id == tenant)


@pytest.mark.parametrize("kv_share_limit", [True, False])
def test_tenant_is_not_admitted_past_its_kv_share_while_another_waits(kv_share_limit: bool) -> None:
    """The KV share rule: while another tenant has a request waiting, a tenant is admitted only if
    the device blocks it then holds stay within its weighted share, num_device_blocks * w /
    (sum of w over tenants with unfinished requests). Running requests are never cut back (they may
    grow past the share), and a tenant with nothing running may always start one request, however
    large. Here a (weight 1) and b (weight 3) share 128 blocks, so a's share is 32 blocks."""
    sim = make_sim({"a": 1.0, "b": 3.0}, kv_share_limit=kv_share_limit, num_device_blocks=128,
                   max_num_seqs=32, max_num_batched_tokens=256)
    share = 128 * 1.0 / 4.0
    admitted_past_share, admitted_while_b_waits = 0, 0
    for _ in range(600):
        sim.keep_backlogged(["a", "b"], PROMPTS, OUTPUTS, depth=6)
        newcomers = {r.request_id for r in sim.scheduler.waiting[INTERACTIVE] if r.tenant_id == "a"}
        plan = sim.scheduler.schedule()
        a_admitted = [s for s in plan.sequences if s.request_id in newcomers]
        b_still_waits = sim.num_waiting("b") > 0
        num_a_running = sum(r.tenant_id == "a" for r in sim.scheduler.running)
        if a_admitted and b_still_waits and num_a_running > 1:
            admitted_while_b_waits += 1
            admitted_past_share += held_blocks(sim, "a") > share
        sim.scheduler.update(plan, sim.executor.execute(plan))
    assert admitted_while_b_waits > 10, admitted_while_b_waits
    assert (admitted_past_share == 0) is kv_share_limit, admitted_past_share


def test_request_larger_than_its_tenants_share_still_runs() -> None:
    """a's only request needs 50 blocks at once, more than its 32-block share, while b keeps requests
    waiting: with nothing of a's running, the request is admitted instead of waiting forever."""
    sim = make_sim({"a": 1.0, "b": 1.0}, num_device_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
    big = None
    for step in range(60):
        sim.keep_backlogged(["b"], [16], [8], depth=4)
        if step == 5:
            big = sim.submit("a", 200, 8)
        sim.step()
    assert big is not None and big.request_id in sim.finished
    assert sim.service[(INTERACTIVE, "b")] > 0


def test_max_concurrent_caps_a_tenant_and_lets_others_go_ahead() -> None:
    """a may run 2 requests at once. It has the smallest counter (it is lighter than b per request)
    yet never runs more than 2, and b fills the remaining slots instead of the step going short."""
    sim = make_sim({"a": 1.0, "b": 1.0}, limits={"a": TenantLimits(max_concurrent=2)}, max_num_seqs=8,
                   num_device_blocks=1024)
    for _ in range(300):
        sim.keep_backlogged(["a"], [16], [8], depth=4)
        sim.keep_backlogged(["b"], [64], [48], depth=4)
        sim.step()
    most_a_running = max(record.running["a"] for record in sim.history)
    num_full = sum(record.running.total() == 8 for record in sim.history)
    assert most_a_running == 2
    assert num_full >= 0.9 * len(sim.history), num_full
    assert sim.scheduler.vtc[INTERACTIVE].get("a") < sim.scheduler.vtc[INTERACTIVE].get("b")


def test_tenant_held_at_max_concurrent_does_not_hold_memory_back_from_others() -> None:
    """a may run one request at a time and keeps more waiting. Those waiting requests cannot be
    admitted anyway, so they do not invoke the KV share rule against b: b gets the same service as
    with the rule switched off, instead of being held to half the memory while the rest sits idle."""
    service_of_b = {}
    for kv_share_limit in (True, False):
        sim = make_sim({"a": 1.0, "b": 1.0}, limits={"a": TenantLimits(max_concurrent=1)},
                       kv_share_limit=kv_share_limit, num_device_blocks=128)
        for _ in range(400):
            sim.keep_backlogged(["a"], [16], [8], depth=4)
            sim.keep_backlogged(["b"], PROMPTS, OUTPUTS, depth=8)
            sim.step()
        assert max(record.running["a"] for record in sim.history) == 1
        service_of_b[kv_share_limit] = sim.service[(INTERACTIVE, "b")]
    assert service_of_b[True] >= 0.95 * service_of_b[False], service_of_b
