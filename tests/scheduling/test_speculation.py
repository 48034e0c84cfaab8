"""Speculative decoding as the scheduler owns it (scheduling/speculation.py), on the fake executor, which
accepts a proposal exactly when it is the token it would have sampled: the proposers, the output unchanged,
rejected proposals' blocks given back, stops among accepted proposals, preemption, and the tenant charged
for every token computed for it."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.fake_executors import FakeExecutor, LinearStepCost
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.speculation import (
    NgramProposer,
    SpeculationConfig,
    Speculator,
    best_draft_count,
    expected_accepted,
)
from scheduling.step_cost import CostCoefficients
from scheduling.step_shaper import ShapingConfig
from tests.factories import make_request, make_scheduler, prompt_tokens, run_step, run_to_completion, tokens_of

NGRAM = SpeculationConfig("ngram", num_speculative_tokens=4)
SUFFIX = SpeculationConfig("suffix", num_speculative_tokens=4)


class CopyingExecutor(FakeExecutor):
    """Requests whose id starts with "copy" repeat their prompt forever (position p gets prompt[p % len]):
    prompt lookup proposes exactly what it samples. Every other request gets the fake's noise."""

    def __init__(self, scheduler: Scheduler, prompts: dict[str, list[int]]) -> None:
        super().__init__(scheduler.geometry)
        self.prompts = prompts

    def token_for(self, request_id: str, position: int) -> int:
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return super().token_for(request_id, position)
        return prompt[position % len(prompt)]


def copy_request(length: int = 24, max_tokens: int = 40, *, tenant_id: str = "default",
                 priority: PriorityClass = PriorityClass.INTERACTIVE) -> Request:
    request = make_request(prompt_tokens(length, salt=next(_salts)), max_tokens, tenant_id=tenant_id,
                           priority=priority)
    request.request_id = RequestId("copy-" + request.request_id)
    return request


_salts = itertools.count(1)


def run(config: SpeculationConfig | None, requests: list[Request], **scheduler_args: object
        ) -> tuple[Scheduler, dict[RequestId, list[TokenEvent]]]:
    scheduler = make_scheduler(SchedulerConfig(speculation=config, shaping=ShapingConfig(enabled=False)),
                               **scheduler_args)  # type: ignore[arg-type]
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in requests})
    for request in requests:
        scheduler.add_request(Request(request.request_id, list(request.prompt_token_ids), request.max_tokens,
                                      request.sampling, request.stop_token_ids, request.tenant_id, request.priority))
    return scheduler, run_to_completion(scheduler, executor)


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(SpeculationConfig("ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3]
    # [1, 2, 3] occurred once before, at the start: what followed it, not what followed the later [2, 3]
    assert proposer.propose("r", tokens, 3) == ([9, 9, 2], 3)
    assert proposer.propose("r", [*tokens, 4], 3) == ([], 0)  # nothing ever followed by 4
    tokens += [4, 6, 2, 3]  # the index catches up: now [2, 3] last ended before 4
    assert proposer.propose("r", tokens, 2) == ([4, 6], 2)


def test_a_match_near_the_end_proposes_the_loop_it_would_copy() -> None:
    proposer = NgramProposer(SpeculationConfig("ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    assert proposer.propose("r", [5, 9, 7, 7, 7], 4) == ([7, 7, 7, 7], 2)  # period 1
    assert proposer.propose("s", [5, 1, 2, 3, 1, 2, 3, 1], 5) == ([2, 3, 1, 2, 3], 3)  # period 3


def test_suffix_proposes_from_the_tenants_recent_outputs_and_never_another_tenants() -> None:
    speculator = Speculator(SpeculationConfig("suffix", prompt_lookup_min=2, prompt_lookup_max=4))
    answer = [50, 51, 52, 53, 54, 55, 56]
    speculator.finished("old", "acme", answer)
    assert speculator.propose("new", "acme", [7, 8, 50, 51, 52], 3) == [53, 54, 55]
    assert speculator.propose("rival", "globex", [7, 8, 50, 51, 52], 3) == []
    assert Speculator(NGRAM).propose("new", "acme", [7, 8, 50, 51, 52], 3) == []  # ngram reads no history


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_the_output_is_the_same_with_speculation_on_in_fewer_steps(config: SpeculationConfig) -> None:
    requests = [copy_request(), copy_request(30, 50), make_request(16, 30), copy_request(12, 20)]
    plain, plain_events = run(None, requests)
    speculating, events = run(config, requests)
    for request in requests:
        assert tokens_of(events[request.request_id]) == tokens_of(plain_events[request.request_id])
    counters = speculating.speculator.counters  # type: ignore[union-attr]
    assert counters.num_accepted_tokens > 60
    assert speculating.counters.num_steps < 0.5 * plain.counters.num_steps
    assert speculating.blocks.device.num_free == speculating.blocks.device.num_blocks


def test_rejected_proposals_give_their_blocks_back_at_once() -> None:
    """After every step each running request holds the blocks its tokens need, no more."""
    requests = [copy_request(1, 60) for _ in range(3)]
    for request in requests:  # repeating itself, the output meets [a b c] followed once by d, once by x
        start = prompt_tokens(6, salt=next(_salts))
        request.prompt_token_ids = request.token_ids = [*start, *start[:3], 255, *prompt_tokens(5, salt=next(_salts))]
        request.num_prompt_tokens = len(request.prompt_token_ids)
    scheduler = make_scheduler(SchedulerConfig(speculation=NGRAM), num_device_blocks=64)
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in requests})
    for request in requests:
        scheduler.add_request(request)
    proposed = 0
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        proposed += sum(seq.num_draft_tokens for seq in plan.sequences)
        for request in scheduler.running:
            assert scheduler.blocks.num_device_blocks(request.request_id) <= -(-request.num_tokens // 4)
    counters = scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens == proposed
    assert 0 < counters.num_accepted_tokens < proposed  # some rejected
    assert scheduler.blocks.device.num_free == scheduler.blocks.device.num_blocks


def test_a_stop_token_among_accepted_proposals_ends_the_output_there() -> None:
    request = copy_request(10, 100)
    stop = request.prompt_token_ids[3]  # its output repeats the prompt: the stop comes at output position 3
    request.stop_token_ids = frozenset({stop})
    _, plain = run(None, [request])
    _, events = run(NGRAM, [request])
    assert tokens_of(events[request.request_id]) == tokens_of(plain[request.request_id])
    assert tokens_of(events[request.request_id])[-1] == stop
    assert events[request.request_id][-1].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [13, 14, 15, 16, 17])
def test_max_tokens_holds_exactly_whatever_was_accepted(max_tokens: int) -> None:
    request = copy_request(10, max_tokens)
    _, events = run(NGRAM, [request])
    assert len(tokens_of(events[request.request_id])) == max_tokens
    assert events[request.request_id][-1].finish_reason == "length"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_between_verifications_changes_no_token(mode: str) -> None:
    """Batch requests speculating in a pool too small for them and the interactive ones that preempt them."""
    batch = [copy_request(20, 60, priority=PriorityClass.BATCH) for _ in range(4)]
    interactive = [copy_request(20, 30) for _ in range(3)]
    _, plain_events = run(None, batch + interactive, num_device_blocks=40, num_cpu_blocks=64)
    config = SchedulerConfig(speculation=NGRAM, preemption_mode=mode, shaping=ShapingConfig(enabled=False))
    scheduler = make_scheduler(config, num_device_blocks=40, num_cpu_blocks=64)
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in batch + interactive})
    events: dict[RequestId, list[TokenEvent]] = {}
    for request in batch:
        scheduler.add_request(Request(request.request_id, list(request.prompt_token_ids), request.max_tokens,
                                      priority=request.priority))
    for _ in range(12):  # the batch requests run and speculate; then the interactive ones arrive
        for event in run_step(scheduler, executor)[1]:
            events.setdefault(event.request_id, []).append(event)
    for request in interactive:
        scheduler.add_request(Request(request.request_id, list(request.prompt_token_ids), request.max_tokens))
    for request_id, more in run_to_completion(scheduler, executor).items():
        events.setdefault(request_id, []).extend(more)
    assert scheduler.counters.preemptions[mode] > 0
    for request in batch + interactive:
        assert tokens_of(events[request.request_id]) == tokens_of(plain_events[request.request_id])
    assert scheduler.blocks.device.num_free == scheduler.blocks.device.num_blocks
    assert scheduler.blocks.cpu.num_free == scheduler.blocks.cpu.num_blocks


def test_a_tenant_whose_proposals_all_stand_gets_no_more_than_its_share() -> None:
    """Two equal tenants backlogged, one's requests accepting every proposal and the other's none: measured
    in tokens computed (each proposal verified is computed work), each gets half (Jain's index)."""
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=4, speculation=NGRAM, shaping=ShapingConfig(enabled=False)),
                               num_device_blocks=512)
    copying = [copy_request(16, 32, tenant_id="copier") for _ in range(200)]
    noisy = [make_request(prompt_tokens(8) * 2, 32, tenant_id="noisy") for _ in range(200)]
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in copying})
    for request in itertools.chain(*zip(copying, noisy, strict=True)):
        scheduler.add_request(request)
    computed = {"copier": 0, "noisy": 0}
    output = {"copier": 0, "noisy": 0}
    for _ in range(300):
        plan, events = run_step(scheduler, executor)
        for seq in plan.sequences:
            computed[scheduler_tenant(plan, seq.request_id, copying)] += len(seq.token_ids)
        for event in events:
            output[scheduler_tenant(plan, event.request_id, copying)] += len(event.new_token_ids)
    assert all(scheduler.waiting[PriorityClass.INTERACTIVE].queued_by_tenant().values())  # both still backlogged
    total = sum(computed.values())
    jain = total ** 2 / (2 * sum(v ** 2 for v in computed.values()))
    assert jain >= 0.98, computed
    by_tenant = scheduler.speculator.counters.by_tenant  # type: ignore[union-attr]
    assert by_tenant["copier"][2] == by_tenant["copier"][1] > 500  # every one of its many proposals stood
    assert output["copier"] <= 1.1 * output["noisy"], output  # and it bought no more output than its share


def scheduler_tenant(_plan: object, request_id: str, copying: list[Request]) -> str:
    return "copier" if request_id.startswith("copy-") else "noisy"


def test_no_proposal_once_the_step_is_compute_bound() -> None:
    """With a fixed cost per step and little per token (weight reads), proposals pay; once each token costs
    as much as the step's fixed part (a compute-bound batch), none does."""
    memory_bound = CostCoefficients(fixed_s=0.015, per_token_s=0.001, per_sequence_s=0.0, per_attention_s=0.0,
                                    per_swapped_block_s=0.0)
    k, _ = best_draft_count(4, 0.8, 100, 1, 1.0, memory_bound.fixed_s + 0.001, memory_bound, lambda n: 0.0)
    assert k == 4
    compute_bound = CostCoefficients(fixed_s=0.001, per_token_s=0.01, per_sequence_s=0.0, per_attention_s=0.0,
                                     per_swapped_block_s=0.0)
    predicted = compute_bound.fixed_s + 32 * 0.01
    assert best_draft_count(4, 0.8, 100, 32, 32.0, predicted, compute_bound, lambda n: 0.0) == (0, 0.0)
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)


def calibrated_scheduler(costs: LinearStepCost) -> Scheduler:
    """A scheduler speculating with NGRAM, unshaped, its cost model calibrated on `costs`."""
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, speculation=NGRAM,
                                               shaping=ShapingConfig(enabled=False)), num_device_blocks=2048)
    for plan in scheduler.calibration_steps():
        scheduler.observe_calibration(plan, costs.seconds(plan))
    return scheduler


def speculated_share(costs: LinearStepCost, num_requests: int) -> float:
    """Copying requests decoding together, the cost model calibrated on `costs` and fed each step's time: the
    share of their decodes that verified proposals, in steps computing no prompt (the prompts start a step
    or two apart, Scheduler._spaces_prompts)."""
    scheduler = calibrated_scheduler(costs)
    requests = [copy_request(16, 48) for _ in range(num_requests)]
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in requests})
    for request in requests:
        scheduler.add_request(request)
    decodes = verifying = 0
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        scheduler.observe_step_time(plan, costs.seconds(plan))
        if any(seq.start_position < 16 for seq in plan.sequences):
            continue
        steps = [seq for seq in plan.sequences if seq.needs_sample]
        decodes += len(steps)
        verifying += sum(1 for seq in steps if seq.num_draft_tokens)
    return verifying / decodes


def test_proposals_are_verified_where_rows_are_cheap_and_not_once_the_step_is_compute_bound() -> None:
    """A step that costs its fixed part (weight reads) takes proposals; a step that costs its tokens alone
    (compute-bound) gains nothing from them, however well they are accepted, and the scheduler makes none."""
    assert speculated_share(LinearStepCost(overhead_s=0.020, per_token_s=0.0005), 1) > 0.8
    assert speculated_share(LinearStepCost(overhead_s=0.020, per_token_s=0.0005), 8) > 0.8
    assert speculated_share(LinearStepCost(overhead_s=0.0, per_token_s=0.004), 8) == 0.0


def test_interactive_decodes_take_the_budget_for_proposals_before_batch_ones() -> None:
    """A token budget with room for one decode's proposals: the interactive request's get it."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2 + NGRAM.num_speculative_tokens, speculation=NGRAM,
                             shaping=ShapingConfig(enabled=False))
    scheduler = make_scheduler(config, num_device_blocks=256)
    batch = copy_request(16, 60, priority=PriorityClass.BATCH)
    interactive = copy_request(16, 60)
    executor = CopyingExecutor(scheduler, {r.request_id: list(r.prompt_token_ids) for r in (batch, interactive)})
    scheduler.add_request(batch)
    scheduler.add_request(interactive)
    drafts = {batch.request_id: 0, interactive.request_id: 0}
    both_decoding = 0
    for _ in range(30):  # both prefill in chunks, then decode
        plan, _ = run_step(scheduler, executor)
        if sum(1 for seq in plan.sequences if seq.start_position >= 16) == 2:
            both_decoding += 1
            for seq in plan.sequences:
                drafts[seq.request_id] += seq.num_draft_tokens  # type: ignore[index]
    assert both_decoding >= 10
    assert drafts[interactive.request_id] > 20
    assert drafts[batch.request_id] == 0


def test_no_proposals_are_verified_in_a_step_that_starts_a_prompt_beside_the_streams() -> None:
    """A copying stream verifies proposals in its decode steps, but not in the step that computes another
    request's new prompt: beside a long prompt step they look cheap, yet the tokens they win move streams
    a step on, and closed-loop streams so moved drift into sending their prompts together."""
    costs = LinearStepCost(overhead_s=0.020, per_token_s=0.0005)
    scheduler = calibrated_scheduler(costs)
    stream = copy_request(16, 200)
    executor = CopyingExecutor(scheduler, {stream.request_id: list(stream.prompt_token_ids)})
    scheduler.add_request(stream)
    drafts_alone = 0
    for _ in range(10):
        plan, _ = run_step(scheduler, executor)
        scheduler.observe_step_time(plan, costs.seconds(plan))
        drafts_alone += sum(seq.num_draft_tokens for seq in plan.sequences)
    assert drafts_alone > 0

    scheduler.add_request(make_request(prompt_tokens(200, salt=99), 4))
    plan, _ = run_step(scheduler, executor)
    assert [len(seq.token_ids) for seq in plan.sequences] == [1, 200]  # the stream's decode, without proposals
    plan, _ = run_step(scheduler, executor)
    assert any(seq.num_draft_tokens for seq in plan.sequences)  # and in the next step, with them again
