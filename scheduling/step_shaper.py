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
the predicted time of the interactive work alone: what the stream would see without batch work,
plus a margin. With no interactive request active, or before the model has seen enough steps,
nothing is shaped, and neither is batch work in a step that holds no interactive work (the
unfinished interactive requests then all wait on something else, maybe on this batch work). A
per-tenant or per-request target would be the smallest target among the step's interactive
requests, passed where `_target_s` is computed.
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
    interactive_itl_slack: float = 1.1  # the derived target: this times the interactive work's predicted time


@dataclass(slots=True)
class ShapingCounters:
    shaped_steps: int = 0
    batch_tokens_deferred: int = 0  # batch tokens a step had room for in its token budget but not in its time


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

    def may_shape(self, interactive_active: bool, batch_unfinished: bool) -> bool:
        """Whether this step can shape anything at all: when not, `fit` grants every request what it
        wants, and the scheduler skips asking for each one (and counting the work of the interactive
        requests waiting). Under a derived target only batch work is shaped, so with no batch request
        unfinished nothing is."""
        return (self.config.enabled and self.cost_model.coefficients is not None and interactive_active
                and (batch_unfinished or self.config.interactive_itl_target_s is not None))

    def add_demand(self, demand: StepWork, num_new: int, start_position: int) -> None:
        """Count a waiting interactive request's coming chunk in the work the budget is opened after: all
        of it under a derived target; under a fixed one only the block it gets whatever the budget."""
        if self.config.interactive_itl_target_s is not None and num_new > 1:
            num_new = min(num_new, self.block_size)
        demand.add_sequence(num_new, start_position)

    def open_budget(self, step: StepBuilder, interactive_demand: StepWork, may_shape: bool,
                    opened_for: PriorityClass = PriorityClass.BATCH) -> None:
        """Once per step, when its unshaped interactive work is chosen: the time the rest may take.
        `interactive_demand` is the work of interactive requests to be admitted later in the step;
        `may_shape` is what `may_shape` answered for the step; `opened_for` is the class of the request
        whose work is shaped first (an interactive prefill chunk, under a fixed target)."""
        if step.shaping_decided:
            return
        step.shaping_decided = True
        coefficients = self.cost_model.coefficients
        if not may_shape or coefficients is None:
            return
        interactive = combined(work_of(step.plan, swaps=False), interactive_demand, len(step.plan.swap_out))
        if not interactive.sequences and opened_for is PriorityClass.BATCH:
            # Only batch work is coming: the unfinished interactive requests all wait on something else
            # (their KV share, say). There is nothing to protect, and a budget could leave batch no token
            # at all (a derived target is 1.1x an empty step's fixed cost, a fixed one may be below it):
            # nothing would ever move.
            return
        predicted = coefficients.predict(interactive)
        step.shaped_time_left_s = max(0.0, self._target_s(predicted) - predicted)
        self.counters.shaped_steps += 1

    def _target_s(self, interactive_predicted_s: float) -> float:
        fixed = self.config.interactive_itl_target_s
        return fixed if fixed is not None else self.config.interactive_itl_slack * interactive_predicted_s

    def fit(self, step: StepBuilder, request: Request, wanted: int, swap_in_blocks: int = 0) -> int:
        """How many of the wanted tokens the request may compute in this step, and take their time."""
        coefficients, time_left = self.cost_model.coefficients, step.shaped_time_left_s
        if time_left is None or coefficients is None or wanted <= 0:
            return wanted
        start = request.num_computed_tokens
        swap_s = coefficients.per_swapped_block_s * swap_in_blocks

        def cost(n: int) -> float:
            return coefficients.added_by(n, start) + swap_s

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
        """What shaping never takes: batch_min_share's tokens for batch; a block's worth for an
        interactive prefill under a fixed target, so it always progresses."""
        if request.priority is PriorityClass.BATCH:
            return min(wanted, max(0, step.batch_floor_tokens - step.batch_tokens))
        return min(wanted, self.block_size)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """Feed the model a step the executor ran: what it held, and how long it took."""
        if plan.sequences:
            self.cost_model.observe(work_of(plan), seconds)


def combined(work: StepWork, other: StepWork, swapped_blocks: int) -> StepWork:
    return StepWork(work.tokens + other.tokens, work.sequences + other.sequences, work.attention + other.attention,
                    swapped_blocks)


def work_of(plan: StepPlan, swaps: bool = True) -> StepWork:
    """What the plan holds, as the cost model counts it (counted when needed: not for every sequence added).
    Once per step over every sequence: `StepWork.add_sequence`'s sums, without a call for each."""
    num_tokens, context_read = 0, 0.0
    for seq in plan.sequences:
        num_new = len(seq.token_ids)
        num_tokens += num_new
        context_read += num_new * (seq.start_position + (num_new + 1) / 2)
    return StepWork(num_tokens, len(plan.sequences), context_read / ATTENTION_UNIT,
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
