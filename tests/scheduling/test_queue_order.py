"""The order inside a tenant's line (scheduling/queue_order.py), on the fake executor: short work first under
HRRN and SRPT with the long request inside its aging bound, the longest cached prefix first under LPM (and
never another tenant's), a deadline before slack-rich requests, and the shares across tenants unchanged."""

from __future__ import annotations

import random

import pytest

from benchmarks.fake_executors import FakeExecutor, LinearStepCost
from scheduling.fcfs_bound import FcfsBound
from scheduling.output_lengths import OutputLengths
from scheduling.queue_order import QUEUE_ORDERS
from scheduling.request import PriorityClass, Request, RequestStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.step_shaper import ShapingConfig
from tests.factories import VirtualClock, make_geometry, make_request, prompt_tokens

INTERACTIVE = PriorityClass.INTERACTIVE
COST = LinearStepCost(overhead_s=0.005, per_token_s=0.001)


class Line:
    """A scheduler that runs one sequence at a time, so the order it starts requests in is the line's."""

    def __init__(self, order: str, max_num_seqs: int = 1, aging_s: float = 30.0, fcfs_stretch: float = 1.3,
                 long_prefill_token_threshold: int | None = None) -> None:
        self.clock = VirtualClock()
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, queue_order=order,  # type: ignore[arg-type]
                                 queue_aging_s=aging_s, queue_fcfs_stretch=fcfs_stretch,
                                 long_prefill_token_threshold=long_prefill_token_threshold,
                                 shaping=ShapingConfig(enabled=False))
        self.scheduler = Scheduler(config, make_geometry(num_device_blocks=1024), clock=self.clock)
        self.executor = FakeExecutor(self.scheduler.geometry, COST)
        self.started: list[str] = []

    def add(self, prompt: int | list[int], max_tokens: int, tenant: str = "t", deadline_s: float | None = None,
            salt: str = "") -> Request:
        request = make_request(prompt, max_tokens, tenant_id=tenant, arrival_time=self.clock.now)
        request.cache_salt = salt or tenant
        request.ttft_deadline = None if deadline_s is None else self.clock.now + deadline_s
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        plan = self.scheduler.schedule()
        for seq in plan.sequences:
            if seq.request_id not in self.started:
                self.started.append(seq.request_id)
        self.scheduler.update(plan, self.executor.execute(plan))
        self.clock.now += COST.seconds(plan) or 0.001

    def run(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError("work left after the step limit")


def long_then_short(order: str, aging_s: float = 30.0) -> tuple[Line, Request, list[Request]]:
    line = Line(order, aging_s=aging_s)
    line.add(8, 4)  # running: the others queue behind it
    line.step()
    long = line.add(200, 200)
    short = [line.add(8, 4) for _ in range(6)]
    line.run()
    return line, long, short


@pytest.mark.parametrize("order", ["hrrn", "srpt"])
def test_short_requests_go_before_a_long_one_that_came_first(order: str) -> None:
    line, long, short = long_then_short(order)
    assert all(line.started.index(s.request_id) < line.started.index(long.request_id) for s in short)


def test_first_come_first_served_keeps_arrival_order() -> None:
    line, long, short = long_then_short("fcfs")
    assert all(line.started.index(long.request_id) < line.started.index(s.request_id) for s in short)


def test_srpt_lets_a_request_waiting_past_its_aging_bound_go_first() -> None:
    """Short requests keep coming; the long one starts once it has waited the aging bound, not after all."""
    line = Line("srpt", aging_s=0.5)
    line.add(8, 4)
    line.step()
    long = line.add(200, 50)
    for _ in range(400):
        line.add(8, 4)
        line.step()
        if long.status is not RequestStatus.WAITING:
            break
    assert long.status is not RequestStatus.WAITING
    assert long.first_scheduled_time is not None
    assert long.first_scheduled_time - long.arrival_time <= 0.5 + 0.2  # the bound, plus a step or two


def shorts_passing_a_long_request(order: str, fcfs_stretch: float, num_shorts: int = 100) -> tuple[int, bool]:
    """Behind one running request, a 200-token request arrives with no prompt ahead of it, then an 8-token
    one in every step, one running at a time: how many short ones start before it, and whether it started
    (aging in seconds out of reach)."""
    line = Line(order, aging_s=1e9, fcfs_stretch=fcfs_stretch)
    line.add(8, 4)
    line.step()
    long = line.add(200, 4)
    for _ in range(num_shorts):
        line.add(8, 4)
        line.step()
        if long.status is not RequestStatus.WAITING:
            break
    return len([r for r in line.started[1:] if r != long.request_id]), long.status is not RequestStatus.WAITING


@pytest.mark.parametrize("order", ["hrrn", "srpt"])
def test_a_long_request_is_passed_over_only_as_far_as_the_fcfs_bound_allows(order: str) -> None:
    """FCFS gives its first token after its own 200 tokens; with a stretch of 1.3 it must have it within 260
    of the line's tokens, so the short ones may compute 60 before it starts: eight, the eighth crossing."""
    passed, started = shorts_passing_a_long_request(order, 1.3)
    assert started and 1 <= passed <= 8


def test_the_fcfs_bound_forgets_every_request_that_ends() -> None:
    line, _, _ = long_then_short("srpt")
    assert not line.scheduler.has_work() and len(line.scheduler.fcfs_bound) == 0


def test_without_the_fcfs_bound_srpt_passes_a_long_request_over_while_short_ones_come() -> None:
    passed, started = shorts_passing_a_long_request("srpt", 0.0)
    assert not started and passed == 25  # a short one every step, each running four steps


def test_the_fcfs_bound_grows_with_the_work_ahead_and_discounts_cached_prefixes() -> None:
    bound = FcfsBound(stretch=1.5)
    ahead = make_request(100, 4, tenant_id="t")
    other_tenant = make_request(1000, 4, tenant_id="u")
    for request in (ahead, other_tenant):
        bound.arrived(request)
    bound.found_cached(ahead, 20)  # 80 of its tokens are left to compute
    late = make_request(40, 4, tenant_id="t")
    bound.arrived(late)  # FCFS: 80 + 40 tokens of the line; within 1.5x that it starts after 140 of others'

    bound.computed(late, 10)  # its own tokens move nothing for it
    bound.computed(other_tenant, 500)  # another line's
    bound.computed(ahead, 80)
    assert not bound.is_overdue(late)
    bound.ended(ahead)
    followed = make_request(60, 4, tenant_id="t")
    bound.arrived(followed)
    bound.computed(followed, 60)
    assert bound.is_overdue(late)  # 140 of others' tokens computed since it arrived
    assert not bound.is_overdue(followed)


def test_hrrn_ages_a_long_request_under_a_stream_of_short_ones() -> None:
    """Short requests arrive about as fast as they are served, so some always wait; the long one's ratio
    grows with its wait until it passes theirs. (Past capacity the shorts' ratios grow without end too:
    HRRN bounds nothing there, which is what SRPT's aging bound is for.)"""
    line = Line("hrrn")
    line.add(8, 4)
    line.step()
    long = line.add(200, 50)
    for step in range(2000):
        if step % 4 == 0:
            line.add(8, 4)
        line.step()
        if long.status is not RequestStatus.WAITING:
            break
    assert long.status is not RequestStatus.WAITING  # its ratio grew past the short ones'
    assert sum(r.status is RequestStatus.WAITING for r in line.scheduler.requests.values()) >= 1  # shorts waited


def test_lpm_starts_the_request_whose_prefix_is_cached_first_and_never_another_tenants() -> None:
    line = Line("lpm")
    shared = prompt_tokens(64, salt=7)
    line.add(shared + prompt_tokens(8, salt=1), 4, tenant="a")
    line.run()  # a's prefix is in the device cache now
    line.add(8, 4, tenant="a")
    line.step()  # running: the line forms behind it
    cold = line.add(prompt_tokens(72, salt=2), 4, tenant="a")
    warm = line.add(shared + prompt_tokens(8, salt=3), 4, tenant="a")
    other = line.add(shared + prompt_tokens(8, salt=4), 4, tenant="b")  # the same tokens, another tenant's salt
    assert line.scheduler._cached_prefix_tokens(warm) >= 64
    assert line.scheduler._cached_prefix_tokens(other) == 0
    line.run()
    assert line.started.index(warm.request_id) < line.started.index(cold.request_id)


def test_a_request_with_a_deadline_runs_before_slack_rich_ones() -> None:
    line = Line("fcfs")
    line.add(8, 4)
    line.step()
    relaxed = [line.add(8, 4) for _ in range(4)]
    urgent = line.add(8, 4, deadline_s=0.05)
    line.run()
    assert line.started.index(urgent.request_id) < min(line.started.index(r.request_id) for r in relaxed)


@pytest.mark.parametrize("order", QUEUE_ORDERS)
def test_shares_across_tenants_are_unchanged_by_the_order_inside_them(order: str) -> None:
    """Two equal tenants, both backlogged with mixed lengths: the service each gets is fair (Jain's index
    over their prompt and output tokens), whatever order their own lines keep."""
    line = Line(order, max_num_seqs=4)
    rng = random.Random(5)
    for tenant in ("a", "b"):
        for _ in range(60):
            line.add(rng.choice([8, 16, 120]), rng.choice([2, 8, 40]), tenant=tenant)
    served = {"a": 0, "b": 0}
    for _ in range(300):
        plan = line.scheduler.schedule()
        for seq in plan.sequences:
            served[line.scheduler.requests[seq.request_id].tenant_id] += len(seq.token_ids)  # type: ignore[index]
        line.scheduler.update(plan, line.executor.execute(plan))
        line.clock.now += COST.seconds(plan)
    total = served["a"] + served["b"]
    jain = total ** 2 / (2 * (served["a"] ** 2 + served["b"] ** 2))
    assert jain >= 0.99, served


def test_output_lengths_are_learned_per_tenant_and_prompt_length_and_ranked() -> None:
    lengths = OutputLengths()
    rng = random.Random(0)
    for _ in range(200):
        prompt = rng.choice([10, 100, 1000])
        request = make_request(prompt, 500, tenant_id="t")
        request.predicted_output_tokens = lengths.predict(request)
        request.token_ids += [1] * (prompt // 10 + rng.randint(0, 3))  # longer prompts, longer answers
        lengths.observe(request)
    long_prompt, short_prompt = make_request(1000, 500, tenant_id="t"), make_request(10, 500, tenant_id="t")
    assert lengths.predict(long_prompt) == pytest.approx(101, abs=3)
    assert lengths.predict(short_prompt) == pytest.approx(2, abs=2)
    assert lengths.predict(make_request(10, 500, tenant_id="new")) == 250  # nothing seen: half of max_tokens
    assert lengths.predict(make_request(10, 50, tenant_id="t")) <= 50
    assert lengths.rank_correlation is not None and lengths.rank_correlation > 0.8


def first_token_times(line: Line, requests: list[Request]) -> list[float]:
    """Step until each request has its first token; when each got it."""
    first_token: dict[str, float] = {}
    for _ in range(500):
        line.step()
        for request in requests:
            if request.num_output_tokens and request.request_id not in first_token:
                first_token[request.request_id] = line.clock.now
        if len(first_token) == len(requests):
            return [first_token[r.request_id] for r in requests]
    raise AssertionError("no first token after 500 steps")


def test_a_running_document_leaves_most_of_each_step_to_the_prompts_behind_it() -> None:
    """First come, first served, with room for every request: three 40-token prompts arriving while a
    1,000-token document is computed start beside it (its chunk is held to the long-prefill threshold,
    a quarter of the 256-token budget, while they wait) and get their first tokens long before it."""
    line = Line("fcfs", max_num_seqs=16)
    document = line.add(1000, 4)
    line.step()
    short = [line.add(40, 4) for _ in range(3)]
    times = first_token_times(line, [document, *short])
    assert max(times[1:]) < times[0]


def test_a_threshold_of_the_whole_step_computes_prompts_strictly_in_turn() -> None:
    """`long_prefill_token_threshold` at the step's budget: the running document takes every step, and the
    prompts that arrived behind it get their first tokens after its (first come, first computed)."""
    line = Line("fcfs", max_num_seqs=16, long_prefill_token_threshold=256)
    document = line.add(1000, 4)
    line.step()
    short = [line.add(40, 4) for _ in range(3)]
    times = first_token_times(line, [document, *short])
    assert min(times[1:]) > times[0]


def running_prompts(order: str) -> tuple[float, float]:
    """A tenant's 1,000-token prompt runs; its 300-token prompt arrives and starts beside it: the times of
    their first tokens."""
    line = Line(order, max_num_seqs=16)
    first = line.add(1000, 4)
    line.step()
    second = line.add(300, 4)
    line.step()  # the first's chunk held to the threshold: the second starts in the rest of the step
    assert second.status is RequestStatus.RUNNING and first.status is RequestStatus.RUNNING
    first_at, second_at = first_token_times(line, [first, second])
    return first_at, second_at


@pytest.mark.parametrize("order", ["hrrn", "srpt"])
def test_a_tenants_running_prompts_are_computed_in_its_order(order: str) -> None:
    """The line never forms where there is room for all, so the order applies to the running prompts
    too: the shorter prompt, started second, is computed first."""
    first_at, second_at = running_prompts(order)
    assert second_at < first_at


def test_first_come_first_served_computes_running_prompts_in_the_order_they_started() -> None:
    first_at, second_at = running_prompts("fcfs")
    assert first_at < second_at
