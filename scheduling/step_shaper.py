"""Step shaping: while interactive requests are active, each step holds only as much other work as
keeps its predicted time within the interactive latency target.

A decode's time is the time of the whole step it shares, so an interactive stream slows down with
every batch token computed beside it. The shaper predicts a step's time with the cost model
(scheduling/step_cost.py) and, once the step's interactive work is chosen, opens a time budget:
the target less the predicted time of that work. Batch decodes, batch prefill chunks and swap-ins
take from it and stop when it is spent; a batch request that does not fit keeps its blocks and
skips the step. `batch_min_share` is a floor shaping never takes from batch.

The target is `interactive_itl_target_s` when set (then long interactive prefill chunks are shaped
too, with at least one block each step so they progress), otherwise `interactive_itl_slack` times
the predicted time of the interactive work alone (what the stream would see without batch work, plus
a margin), and at least `interactive_itl_decodes` times a lone decode step's measured time: a few
interactive streams then leave batch work a share of each step (their gap stays within that multiple
of a lone stream's), where the slack alone would starve it. A tenant's own ITL target (`itl_target_ms`
in the tenants file) lowers the target of every step while one of its requests runs. A step that
computes an interactive prompt is held to `interactive_ttft_slack` times its interactive work instead:
the prompt's first token waits for no batch work, and the streams beside it wait for that prompt alone.
Before the model has seen enough steps nothing is shaped; with no interactive request active, only the
arrival budget holds.

The arrival budget: an interactive request that arrives while a step runs waits for that step to end, so
while interactive traffic may arrive (some was unfinished within `arrival_window_s`, or always), no step
is predicted past `arrival_budget_s`: a batch flood's steps are cut to it even when no interactive
request is active (the unfinished ones may all wait on something else, maybe on this batch work), and
an arriving request is in the next step. Derived, it is `arrival_budget_decodes` times a lone decode
step's measured time, so it scales with the machine. The first batch chunk of a step always gets a
block, so batch work moves whatever the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contract.plan import StepPlan
from scheduling.request import PriorityClass, Request
from scheduling.step_builder import StepBuilder
from scheduling.step_cost import ATTENTION_UNIT, StepCostModel, StepWork


@dataclass(slots=True, frozen=True)
class ShapingConfig:
    enabled: bool = True
    interactive_itl_target_s: float | None = None  # a fixed target; None derives it from the interactive work
    interactive_itl_slack: float = 1.1  # the derived target: this times the interactive work's predicted time,
    interactive_itl_decodes: float = 2.0  # and at least this times a lone decode step's measured time
    interactive_ttft_slack: float = 1.0  # a step starting an interactive prompt: this times its interactive work
    arrival_budget_s: float | None = None  # a fixed arrival budget; None derives it as below
    arrival_budget_decodes: float = 4.0  # the derived budget: this times a lone decode step's measured time
    arrival_window_s: float | None = 10.0  # after the last interactive work; None: always expect arrivals


@dataclass(slots=True)
class ShapingCounters:
    shaped_steps: int = 0
    batch_tokens_deferred: int = 0  # batch tokens a step had room for in its token budget but not in its time
    # Steps whose interactive work alone was predicted past a fixed ITL target (the server's or a tenant's):
    # the target shaping could not meet, whatever batch work did.
    itl_target_missed_steps: int = 0


class StepShaper:
    def __init__(self, config: ShapingConfig, block_size: int, cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.cost_model = cost_model or StepCostModel()
        self.counters = ShapingCounters()

    def shapes(self, request: Request) -> bool:
        """Whether this request's work takes from the shaped budget (and so opens it)."""
        if request.priority is PriorityClass.BATCH:
            return True
        return self.config.interactive_itl_target_s is not None and request.num_uncomputed_tokens > 1

    def may_shape(self, interactive_active: bool, batch_unfinished: bool, arrivals_expected: bool = False) -> bool:
        """Whether this step can shape anything at all: when not, `fit` grants every request what it
        wants, and the scheduler skips asking for each one (and counting the work of the interactive
        requests waiting). Under a derived target only batch work is shaped, so with no batch request
        unfinished nothing is; with no interactive request active, only batch work within the arrival
        budget, while arrivals are expected."""
        if not self.config.enabled or self.cost_model.coefficients is None:
            return False
        if not interactive_active:
            return arrivals_expected and batch_unfinished
        return batch_unfinished or self.config.interactive_itl_target_s is not None

    def expects_arrivals(self, seconds_since_interactive: float) -> bool:
        """Whether interactive requests may arrive, given how long ago one was last unfinished."""
        window = self.config.arrival_window_s
        return window is None or seconds_since_interactive <= window

    def arrival_budget_s(self) -> float | None:
        coefficients = self.cost_model.coefficients
        if coefficients is None:
            return None
        if self.config.arrival_budget_s is not None:
            return self.config.arrival_budget_s
        lone_decode_s = self.cost_model.lone_decode_s
        if lone_decode_s is None:
            lone_decode = StepWork()
            lone_decode.add_sequence(1, self.block_size)
            lone_decode_s = coefficients.predict(lone_decode)
        return self.config.arrival_budget_decodes * lone_decode_s

    def add_demand(self, demand: StepWork, num_new: int, start_position: int) -> None:
        """Count a waiting interactive request's coming chunk in the work the budget is opened after: all
        of it under a derived target; under a fixed one only the block it gets whatever the budget."""
        if self.config.interactive_itl_target_s is not None and num_new > 1:
            num_new = min(num_new, self.block_size)
        demand.add_sequence(num_new, start_position)

    def open_budget(self, step: StepBuilder, interactive_demand: StepWork, may_shape: bool,
                    opened_for: PriorityClass = PriorityClass.BATCH, tenant_target_s: float | None = None) -> None:
        """Once per step, when its unshaped interactive work is chosen: the time the rest may take.
        `interactive_demand` is the work of interactive requests to be admitted later in the step;
        `may_shape` is what `may_shape` answered for the step; `opened_for` is the class of the request
        whose work is shaped first (an interactive prefill chunk, under a fixed target);
        `tenant_target_s` the smallest ITL target of a running request's tenant, if any has one."""
        if step.shaping_decided:
            return
        step.shaping_decided = True
        coefficients = self.cost_model.coefficients
        if not may_shape or coefficients is None:
            return
        interactive = combined(work_of(step.plan, swaps=False), interactive_demand, len(step.plan.swap_out))
        predicted = coefficients.predict(interactive) + self.cost_model.residual(interactive.tokens)
        arrival_budget = self.arrival_budget_s() or 0.0
        if not interactive.sequences and opened_for is PriorityClass.BATCH:
            # Only batch work is coming: no stream is decoding, so only arrivals are protected (may_shape
            # said whether any are expected). The first batch chunk gets a block whatever the budget.
            step.shaped_time_left_s = max(0.0, arrival_budget - predicted)
        else:
            target = self._target_s(predicted)
            if tenant_target_s is not None:
                target = min(target, tenant_target_s)
            if predicted > target:
                self.counters.itl_target_missed_steps += 1
            if self.config.interactive_itl_target_s is None and _starts_a_prompt(step, interactive_demand):
                target = min(target, self.config.interactive_ttft_slack * predicted)
            target = min(target, max(arrival_budget, predicted))
            step.shaped_time_left_s = max(0.0, target - predicted)
        self.counters.shaped_steps += 1

    def _target_s(self, interactive_predicted_s: float) -> float:
        fixed = self.config.interactive_itl_target_s
        if fixed is not None:
            return fixed
        lone_decode_s = self.cost_model.lone_decode_s or 0.0
        return max(self.config.interactive_itl_slack * interactive_predicted_s,
                   self.config.interactive_itl_decodes * lone_decode_s)

    def fit(self, step: StepBuilder, request: Request, wanted: int, swap_in_blocks: int = 0) -> int:
        """How many of the wanted tokens the request may compute in this step, and take their time."""
        coefficients, time_left = self.cost_model.coefficients, step.shaped_time_left_s
        if time_left is None or coefficients is None or wanted <= 0:
            return wanted
        start = request.num_computed_tokens
        swap_s = coefficients.per_swapped_block_s * swap_in_blocks

        residual, tokens = self.cost_model.residual, step.num_tokens

        def cost(n: int) -> float:  # the line's, and the change of bucket residual (a kernel change)
            return coefficients.added_by(n, start) + swap_s + residual(tokens + n) - residual(tokens)

        if wanted == 1:  # a decode, the common case: one check, no search
            granted = 1 if cost(1) <= time_left else self._floor(step, request, 1)
        else:
            granted = max(largest_fitting(wanted, lambda n: cost(n) <= time_left), self._floor(step, request, wanted))
        if granted:
            step.shaped_time_left_s = max(0.0, time_left - cost(granted))
        if request.priority is PriorityClass.BATCH:
            self.counters.batch_tokens_deferred += wanted - granted
        return granted

    def _floor(self, step: StepBuilder, request: Request, wanted: int) -> int:
        """What shaping never takes: batch_min_share's tokens for batch, and a block's worth for the first
        batch chunk of a step that holds nothing else (batch work always moves); a block's worth for an
        interactive prefill under a fixed target, so it always progresses."""
        if request.priority is PriorityClass.BATCH:
            if not step.plan.sequences:
                return min(wanted, self.block_size)
            return min(wanted, max(0, step.batch_floor_tokens - step.batch_tokens))
        return min(wanted, self.block_size)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """Feed the model a step the executor ran: what it held, and how long it took."""
        if plan.sequences:
            self.cost_model.observe(work_of(plan), seconds)


def _starts_a_prompt(step: StepBuilder, interactive_demand: StepWork) -> bool:
    """Whether the step computes an interactive prompt chunk: a waiting request's (counted in the demand)
    or a running one's (in the plan before any shaped work; a decode is one token)."""
    return interactive_demand.sequences > 0 or any(len(seq.token_ids) > 1 for seq in step.plan.sequences)


def combined(work: StepWork, other: StepWork, swapped_blocks: int) -> StepWork:
    return StepWork(work.tokens + other.tokens, work.sequences + other.sequences, work.attention + other.attention,
                    swapped_blocks)


def work_of(plan: StepPlan, swaps: bool = True) -> StepWork:
    """What the plan holds, as the cost model counts it (counted when needed: not for every sequence added).
    Once per step over every sequence: `StepWork.add_sequence`'s sums, without a call for each."""
    num_tokens, num_drafts, context_read = 0, 0, 0.0
    for seq in plan.sequences:
        num_new = len(seq.token_ids)
        num_tokens += num_new
        num_drafts += seq.num_draft_tokens
        context_read += num_new * (seq.start_position + (num_new + 1) / 2)
    # A proposed token verified is sampled like a decode: it counts as a sequence (see StepWork).
    return StepWork(num_tokens, len(plan.sequences) + num_drafts, context_read / ATTENTION_UNIT,
                    len(plan.swap_out) + len(plan.swap_in) if swaps else 0)


def largest_fitting(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, limit] with fits(n), for a fits that holds up to some n and not past it."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
