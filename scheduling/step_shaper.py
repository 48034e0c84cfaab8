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
of a lone stream's), where the slack alone would starve it. The derived target holds on average: the room
a step leaves unspent goes to the next ones, measured by the gaps the steps made (see `_settle`), so batch
rows that a CPU's kernels take in groups still run; it is saved up until it fills a step of
`saved_room_budgets` arrival budgets and spent in that one step (`_is_full`, `_spend_ceiling_s`), so
most of the streams' steps hold no batch work and their median gap stays their own. A fixed target
bounds every step. The lone decode is measured: served, or timed on its own between served steps when
the forward changed under load (scheduling/engine.py). A tenant's own ITL target (`itl_target_ms`
in the tenants file) lowers the target of every step while one of its requests runs. A step that
computes an interactive prompt is held to `interactive_ttft_slack` times its interactive work instead:
the prompt's first token waits for no batch work, and the streams beside it wait for that prompt alone.
Before the model has seen enough steps nothing is shaped; with no interactive request active, only the
arrival budget holds.

Tenants' long prompts: while interactive work of more than one tenant is active or may arrive (within
`arrival_window_s`), the chunks of an interactive prompt longer than `long_prompt_tokens` and predicted
past the arrival budget, from a tenant whose interactive VTC counter is not the lowest of them (the
scheduler decides; the tenant served least is never held back), are shaped too, so that one tenant's
long prompts cannot lengthen the steps another tenant's streams decode in, nor hold its arriving prompt
for a whole long step. With no stream decoding such a chunk takes up to the arrival budget. With streams
decoding, long prompts take turns: one step in `long_prompt_every` holds a chunk of them, up to the
arrival budget (or the tenant's ITL target), and at least a block; the other steps hold none, so the
streams' median gap stays their own and their longest is within the arrival budget. A step starting a
prompt gives them no turn (unless they have waited twice their turn: prompts arriving in every step must
not starve them), and a long prompt waiting for its turn holds no other tenant's prompt back in the
queue. On a CPU a few prompt tokens in every step would cost the streams more: a step's first rows past
a decode are its dearest. It is how vLLM's `long_prefill_token_threshold` lets short prompts through
beside long ones, drawn between tenants. One tenant alone is not shaped: its long prompt only waits for
its own work. While another tenant used the server within `long_prompt_chunk_window_s` (work of any class
unfinished) and computes no long prompt of its own, every long interactive prompt, held to turns or not,
is computed in chunks whose steps are predicted within `long_prompt_chunk_budgets` arrival budgets
(`long_prompt_chunk`): the other tenant's request arriving meanwhile waits for a chunk, not for the whole
prompt.

The arrival budget: an interactive request that arrives while a step runs waits for that step to end, so
while interactive traffic may arrive (some was unfinished within `arrival_window_s`, or always), no step
is predicted past `arrival_budget_s` (but a step spending the streams' saved-up room, one in
`saved_room_every` at most, up to `saved_room_budgets` of it): a batch flood's steps are cut to it even
when no interactive request is active (the unfinished ones may all wait on something else, maybe on this
batch work), and an arriving request is in the next step. Derived, it is `arrival_budget_decodes` times a
lone decode step's measured time, so it scales with the machine. The first batch chunk of a step always
gets a block, so batch work moves whatever the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from contract.plan import StepPlan
from scheduling.request import PriorityClass, Request
from scheduling.step_builder import StepBuilder
from scheduling.step_cost import ATTENTION_UNIT, StepCostModel, StepWork

# The derived target stays this far below the arrival budget: a step given the saved-up room runs past it, and
# is counted as spending it (`_settle`). A target cut to the budget itself was never passed, and batch work
# joined every step (a large batch share where the streams' own step is near two lone decodes).
SHARE_CEILING_FRACTION = 0.9


@dataclass(slots=True, frozen=True)
class ShapingConfig:
    enabled: bool = True
    interactive_itl_target_s: float | None = None  # a fixed target; None derives it from the interactive work
    interactive_itl_slack: float = 1.1  # the derived target: this times the interactive work's predicted time,
    interactive_itl_decodes: float = 2.0  # and at least this times a lone decode step's measured time,
    interactive_batch_share: float = 0.55  # and at least the streams' own work / (1 - this): batch's share of time
    interactive_itl_decodes_cross_tenant: float = 1.3  # the same for another tenant's batch work, saved up apart
    served_less_step_slack: float = 1.3  # others' batch may grow a step of the least-served tenant's by this much
    interactive_ttft_slack: float = 1.0  # a step starting an interactive prompt: this times its interactive work
    arrival_budget_s: float | None = None  # a fixed arrival budget; None derives it as below
    arrival_budget_decodes: float = 4.0  # the derived budget: this times a lone decode step's measured time
    arrival_window_s: float | None = 10.0  # after the last interactive work; None: always expect arrivals
    long_prompt_tokens: int = 256  # an interactive prompt longer than this is shaped while tenants share steps
    long_prompt_every: int = 4  # with streams decoding, a long prompt's chunk is in one step in this many
    long_prompt_chunk_budgets: float = 4.0  # a step computing a long prompt's chunk: at most this many arrival budgets
    long_prompt_chunk_window_s: float = 60.0  # ...while another tenant had unfinished work within this long
    saved_room_every: int = 4  # under the derived target, the streams' saved-up room is spent in one step in this many
    saved_room_budgets: float = 1.5  # ...in a step of up to this many arrival budgets (see _spend_ceiling_s)


@dataclass(slots=True)
class ShapingCounters:
    shaped_steps: int = 0
    batch_tokens_deferred: int = 0  # batch tokens a step had room for in its token budget but not in its time
    # Steps whose interactive work alone was predicted past a fixed ITL target (the server's or a tenant's):
    # the target shaping could not meet, whatever batch work did.
    itl_target_missed_steps: int = 0
    # Tokens of tenants' long interactive prompts held to a later step while other tenants shared the steps.
    long_prompt_tokens_deferred: int = 0


class StepShaper:
    def __init__(self, config: ShapingConfig, block_size: int, cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.cost_model = cost_model or StepCostModel()
        self.counters = ShapingCounters()
        self._long_prompt_waits = 0  # steps a tenant's long prompt has waited since its last turn
        self._waited_in: StepBuilder | None = None
        # Under the derived target, the streams' time their steps have left unspent (or overspent, below 0),
        # measured; and the last step shaped under it, with its target and the most credit may reach: the
        # step settles its account once it has run (see _settle).
        self._credit_s = 0.0
        self._unsettled: tuple[StepPlan, float, float] | None = None
        self._steps_since_spent = 0  # steps settled under the derived target since one ran past it
        # Under the derived target, the room the cross-tenant target left in the streams' steps, saved up for
        # other tenants' batch work (see _open_cross_tenant_room).
        self._cross_tenant_credit_s = 0.0
        self._last_step_end: float | None = None  # when the last step observed ended, on the scheduler's clock

    def shapes(self, request: Request) -> bool:
        """Whether this request's work takes from the shaped budget (and so opens it)."""
        if request.priority is PriorityClass.BATCH:
            return True
        return self.config.interactive_itl_target_s is not None and request.num_uncomputed_tokens > 1

    def may_shape(self, interactive_active: bool, batch_unfinished: bool, arrivals_expected: bool = False,
                  tenants_share: bool = False) -> bool:
        """Whether this step can shape anything at all: when not, `fit` grants every request what it
        wants, and the scheduler skips asking for each one (and counting the work of the interactive
        requests waiting). Under a derived target only batch work and, while tenants share the steps
        (`tenants_share`), long interactive prompts are shaped; with no interactive request active, only
        batch work within the arrival budget, while arrivals are expected."""
        if not self.config.enabled or self.cost_model.coefficients is None:
            return False
        if not interactive_active:
            return arrivals_expected and batch_unfinished
        return batch_unfinished or tenants_share or self.config.interactive_itl_target_s is not None

    def is_long_prompt(self, request: Request) -> bool:
        """Whether the request's prompt is long: past `long_prompt_tokens`, and predicted past the arrival
        budget in one step (on a fast device no prompt of that length is, and none is shaped). A property
        of the prompt, not of the chunk left: its last chunks are held as its first were."""
        num_prompt = request.num_prompt_tokens
        coefficients, budget = self.cost_model.coefficients, self.arrival_budget_s()
        if num_prompt <= self.config.long_prompt_tokens or coefficients is None or budget is None:
            return False
        return coefficients.added_by(num_prompt, 0) > budget

    def long_prompt_chunk(self, step: StepBuilder, request: Request, wanted: int, waiting_work: StepWork) -> int:
        """How many of the wanted tokens of a long interactive prompt (see is_long_prompt) this step computes,
        while other tenants use the server (the scheduler decides): as many as keep the step, with the
        interactive work it holds and `waiting_work` (the waiting interactive prompts it will start),
        within `long_prompt_chunk_budgets` arrival budgets, and at least one arrival budget's worth. Another
        tenant's request arriving meanwhile waits for a chunk, not for the whole prompt: a 471-token prompt
        computed in one 2.3 s step (its tenant served least, or the other tenant's chats unseen for the
        arrival window while its batch finished) had that tenant's chats wait 2.3-4.8 s for their first
        tokens (4.2x alone).

        Four budgets, not one: each chunk pays a step's fixed cost again (about a lone decode: the weights
        read), a sixteenth of a chunk of four budgets and a quarter of a chunk of one. And a chunk is sized
        as if it had no context before it: sized with its attention to the context, chunks of a 3,300-token
        prompt shrank to 35 tokens at the end, each step paying its fixed costs and its pass over the context
        again, and the prompt took 30% longer (22.5 s against 29.3 s, docs/loadtest.md)."""
        coefficients, budget = self.cost_model.coefficients, self.arrival_budget_s()
        if not self.config.enabled or coefficients is None or budget is None or wanted <= 1:
            return wanted
        so_far = coefficients.predict(combined(work_of(step.plan, swaps=False), waiting_work, 0))
        time_left = max(self.config.long_prompt_chunk_budgets * budget - so_far, budget)
        fitting = largest_fitting(wanted, lambda n: coefficients.added_by(n, 0) <= time_left)
        return max(fitting, min(wanted, self.block_size))

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
            self._credit_s = 0.0
            return
        interactive = combined(work_of(step.plan, swaps=False), interactive_demand, len(step.plan.swap_out))
        predicted = coefficients.predict(interactive) + self.cost_model.residual(interactive.tokens)
        arrival_budget = self.arrival_budget_s() or 0.0
        fixed_target = self.config.interactive_itl_target_s is not None
        if not interactive.sequences and (opened_for is PriorityClass.BATCH or not fixed_target):
            # Only shaped work is coming (batch, or tenants' long prompts): no stream is decoding, so only
            # arrivals are protected. The first batch chunk gets a block whatever the budget.
            step.shaped_time_left_s = step.prompt_time_left_s = max(0.0, arrival_budget - predicted)
            step.long_prompt_turn = True
            self._credit_s = 0.0
        else:
            target = self._target_s(predicted)
            if tenant_target_s is not None:
                target = min(target, tenant_target_s)
            streams_target = target
            if predicted > target:
                self.counters.itl_target_missed_steps += 1
            starts_a_prompt = _starts_a_prompt(step, interactive_demand)
            if self.config.interactive_itl_target_s is None and starts_a_prompt:
                target = min(target, self.config.interactive_ttft_slack * predicted)
            ceiling = max(arrival_budget, predicted)
            derived = self._derives_target(tenant_target_s, starts_a_prompt)
            target = min(target, max(predicted, SHARE_CEILING_FRACTION * ceiling) if derived else ceiling)
            credit_s = self._credit_s if derived else 0.0  # a fixed target bounds every step: nothing carried
            most_s = self._spend_ceiling_s(arrival_budget, predicted) if derived else ceiling
            room = max(0.0, min(target - predicted + credit_s, most_s - predicted))
            spends = not derived or (_is_full(room, most_s - predicted)
                                     and self._steps_since_spent >= self.config.saved_room_every - 1)
            step.shaped_time_left_s = room if spends else 0.0
            cross_tenant_target = self._derived_target_s(predicted, self.config.interactive_itl_decodes_cross_tenant)
            cross_tenant_room = max(0.0, min(target, cross_tenant_target) - predicted)
            if derived:
                self._open_cross_tenant_room(step, cross_tenant_room, most_s - predicted)
                self._unsettled = (step.plan, target, most_s - target)
            else:
                step.cross_tenant_time_left_s = cross_tenant_room  # a fixed target bounds every step
            # Tenants' long prompts take turns: a step in long_prompt_every, up to the arrival budget or the
            # streams' own target if longer (a tenant's target bounds both); the streams' other steps hold
            # none of them. On a CPU a few prompt tokens in every step would cost more: a step's first rows
            # past a decode are its dearest.
            every, waits = self.config.long_prompt_every, self._long_prompt_waits
            step.long_prompt_turn = waits >= every - 1 and (not starts_a_prompt or waits >= 2 * every - 1)
            turn_s = self._turn_s(arrival_budget, streams_target, tenant_target_s)
            step.prompt_time_left_s = max(0.0, turn_s - predicted)
        self.counters.shaped_steps += 1

    def _open_cross_tenant_room(self, step: StepBuilder, room_s: float, most_s: float) -> None:
        """Under the derived target, the room the cross-tenant target leaves in this step is saved up. Other
        tenants' batch work beside the streams runs only once that room fills a step of the streams' own saved-up
        room's ceiling (`most_s`), and in a step that spends no room of the streams' own (`_one_spender`).
        Granted a little of every step instead, it ran in 12-19% of a light tenant's steps beside a noisy
        neighbour on a Zen 5 EPYC, and in its pinned prompts' turns (53 ms against 36 ms without). The room
        was about nothing there: the streams' own step is near the target already. Its rows came in where the
        cost model's bucket residual priced them at or below nothing, at the row counts where a CPU's kernels
        change (see `fit`; docs/loadtest.md)."""
        self._cross_tenant_credit_s = min(self._cross_tenant_credit_s + room_s, most_s)
        step.cross_tenant_spends = _is_full(self._cross_tenant_credit_s, most_s)
        step.cross_tenant_time_left_s = self._cross_tenant_credit_s if step.cross_tenant_spends else 0.0

    def _spend_ceiling_s(self, arrival_budget_s: float, predicted_s: float) -> float:
        """The longest step the streams' saved-up room may make: `saved_room_budgets` arrival budgets. Past the
        budget, in one step in `saved_room_every` at most: a CPU computes a step's first rows past the streams'
        own at their dearest (the int4 kernels take rows in groups of four, the int8 copies start at eight) and
        later ones at about half that, so the longer the spending step, the more batch tokens a millisecond of
        the streams' room buys. Beside four streams and a batch flood on a Zen 5 EPYC, spending steps of five
        lone decodes instead of four held 41 batch tokens instead of 22, and batch made 0.66-0.84x llama.cpp's
        server's tokens/s in four runs against 0.39-0.56x before, every latency target held (two runs at
        these defaults: 0.76x and 0.77x, TTFT p50 1.14-1.20x and ITL p50 1.72-1.75x a lone stream's;
        docs/loadtest.md). Only this room: the arrival budget itself, which also sizes the turns and chunks of
        other tenants' long prompts, took a light tenant's ITL p50 beside a neighbour's pinned prompts to
        1.9-2.8x its own."""
        return max(self.config.saved_room_budgets * arrival_budget_s, predicted_s)

    @staticmethod
    def _turn_s(arrival_budget_s: float, streams_target_s: float, tenant_target_s: float | None) -> float:
        """How long a step holding a turn of tenants' long prompts may take: the arrival budget, or the
        streams' own target when longer (many streams decoding: their step alone is past the budget).
        Held to the budget alone, a turn beside 20-30 decoding streams got one block, and a 2,000-token
        prompt took 43-86 s to its first token on the mixed-length trace while prompts of the other tenant
        went by. A tenant's ITL target bounds the turn too."""
        turn_s = max(arrival_budget_s, streams_target_s)
        return turn_s if tenant_target_s is None else min(turn_s, tenant_target_s)

    def _target_s(self, interactive_predicted_s: float) -> float:
        """The streams' own target: a fixed one, or the derived one, at least what leaves batch work
        `interactive_batch_share` of the streams' time. A share of their own steps' time, not a multiple of a
        lone decode: several streams' plain step is itself 1.4-1.7 lone decodes on a CPU, so twice a lone
        decode left batch the difference of two close numbers, and a machine a little slower in one run (its
        plain steps 21 ms instead of 18, the lone decode as before) gave batch 43 tok/s where the same code
        gave 80 in the run before."""
        fixed = self.config.interactive_itl_target_s
        if fixed is not None:
            return fixed
        share = interactive_predicted_s / (1.0 - self.config.interactive_batch_share)
        return max(self._derived_target_s(interactive_predicted_s, self.config.interactive_itl_decodes), share)

    def _derived_target_s(self, interactive_predicted_s: float, lone_decodes: float) -> float:
        """The slack's target, or `lone_decodes` lone decode steps if longer. With `interactive_itl_decodes`
        the streams' own target; with `interactive_itl_decodes_cross_tenant`, what their steps may take on
        average with another tenant's batch work (a fixed target: in every step; see _open_cross_tenant_room):
        one tenant's batch must not slow another tenant's streams as far as the derived target lets work
        beside them (a neighbour's batch flood took a light tenant's ITL p50 to 1.5x, docs/loadtest.md)."""
        lone_decode_s = self.cost_model.lone_decode_s or 0.0
        return max(self.config.interactive_itl_slack * interactive_predicted_s, lone_decodes * lone_decode_s)

    def _derives_target(self, tenant_target_s: float | None, starts_a_prompt: bool) -> bool:
        """Whether the step's target is the derived one, an average the streams' gaps keep: not a fixed
        target (the server's or a tenant's, a bound on every step), nor a step starting a prompt (its
        first token waits for no batch work)."""
        return self.config.interactive_itl_target_s is None and tenant_target_s is None and not starts_a_prompt

    def _settle(self, plan: StepPlan, gap_s: float) -> None:
        """Once a step shaped under the derived target has run: the streams' gap it made (its time, or the
        time since the step before it ended when longer: events delivered and streams written between steps
        are the streams' wait too) against its target goes to the streams' credit.

        A CPU's kernels take decode rows in groups: on the default model here a fifth row costs as much as
        the fifth to the eighth together (4 rows 15 ms, 5 rows 26 ms, 8 rows 27.5 ms), more than a step's
        room, and batch work beside four streams never ran (0 tokens/s). With the room steps leave unspent
        carried over, one step in a few holds a group of batch rows. Measured, not predicted: steps that ran
        past their prediction hold the next steps' batch work back. The streams' gaps keep the target on
        average, and no step is predicted past the room's ceiling (`_spend_ceiling_s`). Debt is forgiven past
        one target's worth (a collector's pause must not stop batch work for long).

        A step that held a turn of tenants' long prompts is not settled: its length is the turn's, bounded by
        `long_prompt_every`, not the streams' room. Settled, each turn overspent the room the streams' own
        tenant's batch work runs in, and a light tenant's 8-line batch beside a neighbour's pinned prompts
        took 4.3x as long as alone, its rows about five a second until the neighbour stopped."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is None or unsettled[0] is not plan:
            return
        _, target, most = unsettled
        self._credit_s = min(max(self._credit_s + target - gap_s, -target), most)
        # A step past its target spent saved-up room (another tenant's batch, held to less, never does).
        self._steps_since_spent = 0 if gap_s > target else self._steps_since_spent + 1

    def open_served_more_budget(self, step: StepBuilder) -> None:
        """Once per step, when the batch work of the tenants served more than the running one served least
        comes up (that one's work, its waiting requests admitted first, is in the step already, see
        Scheduler._tenants_served_more): the time theirs may add, a share of the step so far. On a CPU a
        step's time grows with its rows, and a light tenant's last batch rows, one token a step each, ran in
        the steps of a neighbour's 30: 0.5-0.9 s a token against 40 ms alone (docs/loadtest.md). Where rows
        cost little (a GPU) the share is never reached, and nothing is held."""
        if step.served_more_time_left_s is not None:
            return
        predicted = self.cost_model.predict(work_of(step.plan, swaps=False))
        if predicted is not None:
            step.served_more_time_left_s = max(0.0, (self.config.served_less_step_slack - 1.0) * predicted)

    def fit(self, step: StepBuilder, request: Request, wanted: int, swap_in_blocks: int = 0,
            long_prompt: bool = False, cross_tenant: bool = False, served_more: bool = False) -> int:
        """How many of the wanted tokens the request may compute in this step, and take their time. A
        tenant's `long_prompt` takes only in its turn, from the time turns have (see open_budget); a
        `cross_tenant` request (batch work beside another tenant's interactive requests) only from the
        cross-tenant room, priced at the cost model's line at least (see _open_cross_tenant_room); a
        `served_more` one (batch work of a tenant served more than the running one served least, see
        open_served_more_budget) only from what that left."""
        coefficients, shaped_left = self.cost_model.coefficients, step.shaped_time_left_s
        served_more_left = step.served_more_time_left_s if served_more else None
        if shaped_left is None and served_more_left is not None:
            shaped_left = math.inf  # no interactive shaping in this step: only the served-more share bounds it
        if shaped_left is None or coefficients is None or wanted <= 0:
            return wanted
        time_left = shaped_left if served_more_left is None else min(shaped_left, served_more_left)
        cross_room = step.cross_tenant_time_left_s
        cross_left = cross_room if cross_tenant else None
        if cross_left is not None and step.cross_tenant_spends:  # its own room saved up, not the streams'
            time_left = cross_left if served_more_left is None else min(cross_left, served_more_left)
        elif cross_left is not None:
            time_left = min(time_left, cross_left)
        if long_prompt:
            if not step.long_prompt_turn:  # it waits: the streams' step holds none of it
                self._note_long_prompt_wait(step)
                self.counters.long_prompt_tokens_deferred += wanted
                return 0
            time_left = step.prompt_time_left_s or 0.0
        start = request.num_computed_tokens
        swap_s = coefficients.per_swapped_block_s * swap_in_blocks

        residual, tokens = self.cost_model.residual, step.num_tokens

        def cost(n: int) -> float:  # the line's, and the change of bucket residual (a kernel change)
            line = coefficients.added_by(n, start) + swap_s
            with_residual = line + residual(tokens + n) - residual(tokens)
            # Another tenant's rows are never priced below the line: where the residual falls they came at or
            # below nothing, and a step with no room took them (see _open_cross_tenant_room).
            return max(with_residual, line) if cross_left is not None else with_residual

        if wanted == 1:  # a decode, the common case: one check, no search
            granted = 1 if cost(1) <= time_left else self._floor(step, request, 1)
        else:
            granted = max(largest_fitting(wanted, lambda n: cost(n) <= time_left), self._floor(step, request, wanted))
        if granted:
            spent = cost(granted)
            if step.shaped_time_left_s is not None:
                step.shaped_time_left_s = max(0.0, shaped_left - spent)
            if served_more_left is not None:
                step.served_more_time_left_s = max(0.0, served_more_left - spent)
            if cross_room is not None:  # a row priced below nothing makes no room for another tenant's
                step.cross_tenant_time_left_s = max(0.0, cross_room - max(spent, 0.0))
            if step.cross_tenant_spends and spent > 0:
                self._one_spender(step, cross_tenant=cross_left is not None)
            if long_prompt:
                self._long_prompt_waits = 0
                self._unsettled = None  # a turn's step is not settled (see _settle)
                step.prompt_time_left_s = max(0.0, time_left - spent)
        if request.priority is PriorityClass.BATCH:
            self.counters.batch_tokens_deferred += wanted - granted
        elif long_prompt:
            self.counters.long_prompt_tokens_deferred += wanted - granted
        return granted

    def _one_spender(self, step: StepBuilder, cross_tenant: bool) -> None:
        """A step that may spend the cross-tenant room saved up spends it or other shaped time, not both. The
        first shaped work to take time there decides: batch work (the tenant served least's comes first), or a
        turn of a tenant's long prompt, whose steps are long already. Other tenants' batch work spends all of
        its room, whatever it leaves, so the next steps hold none of it. Such a step is not the streams' own
        room to settle (see _settle): their room stays saved for a step of its own."""
        if cross_tenant:
            self._cross_tenant_credit_s = 0.0
            self._unsettled = None
            step.shaped_time_left_s = 0.0
        else:
            step.cross_tenant_time_left_s = 0.0
            step.cross_tenant_spends = False

    def _note_long_prompt_wait(self, step: StepBuilder) -> None:
        """Count the steps in which a long prompt waited (once each, whatever the number of prompts)."""
        if step is not self._waited_in:
            self._waited_in = step
            self._long_prompt_waits += 1

    def _floor(self, step: StepBuilder, request: Request, wanted: int) -> int:
        """What shaping never takes: batch_min_share's tokens for batch, and a block's worth for the first
        batch chunk of a step that holds nothing else (batch work always moves); a block's worth for an
        interactive prefill under a fixed target or a tenant's long prompt, so it always progresses."""
        if request.priority is PriorityClass.BATCH:
            if not step.plan.sequences:
                return min(wanted, self.block_size)
            return min(wanted, max(0, step.batch_floor_tokens - step.batch_tokens))
        return min(wanted, self.block_size)

    def observe(self, plan: StepPlan, seconds: float, now: float | None = None) -> None:
        """Feed the model a step the executor ran: what it held, how long it took, and when it ended."""
        last_end, self._last_step_end = self._last_step_end, now
        self._settle(plan, seconds if now is None or last_end is None else max(seconds, now - last_end))
        if plan.sequences:
            self.cost_model.observe(work_of(plan), seconds)


def _starts_a_prompt(step: StepBuilder, interactive_demand: StepWork) -> bool:
    """Whether the step computes an interactive prompt chunk: a waiting request's (counted in the demand)
    or a running one's (in the plan before any shaped work; a decode is one token)."""
    return interactive_demand.sequences > 0 or any(len(seq.token_ids) > 1 for seq in step.plan.sequences)


def _is_full(room_s: float, most_s: float) -> bool:
    """Under the derived target the streams save their room up, and batch work beside them joins a step only
    once the room is all its ceiling allows (`_spend_ceiling_s`): the streams' gap is read at its median, and a
    little batch work in most steps puts the median at a step holding some. On a CPU's grouped rows each step with
    batch rows cost a group (4 streams 18.5 ms; with a batch prompt chunk 28 ms), they joined two steps in
    three, and the streams' ITL p50 read 2.1-2.6x a lone stream's. Saved up, the room is spent in fewer
    steps, with more rows each, for the same average. And in one step in `saved_room_every` at most: where
    the streams' own step is near their target, the room fills in a step or two, and spent in every other
    step it put their median gap at a step holding batch work."""
    return room_s >= most_s * (1 - 1e-9)


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
