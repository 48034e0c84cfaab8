"""One step's plan as it is built: the sequences chosen so far, the tokens left in its budget, and the
time left for shaped work."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.plan import ScheduledSequence, StepPlan
from scheduling.block_manager import KVBlockManager
from scheduling.request import PriorityClass, Request


@dataclass(slots=True)
class StepBuilder:
    """The scheduler's phases each add to one builder; only `add` spends the token budget."""

    plan: StepPlan
    tokens_left: int  # of max_num_batched_tokens
    blocks: KVBlockManager  # for each sequence's block table
    # Step shaping (see Scheduler._open_shaped_budget): None while unshaped.
    shaped_time_left_s: float | None = None
    prompt_time_left_s: float | None = None  # what tenants' long interactive prompts may take (step_shaper.py)
    cross_tenant_time_left_s: float | None = None  # what batch work beside another tenant's interactive may take
    cross_tenant_spends: bool = False  # whether that is the cross-tenant room saved up (step_shaper.py)
    served_more_time_left_s: float | None = None  # what batch work of tenants served more than the least may take
    long_prompt_turn: bool = False  # whether they may take any
    decoding_tenants: frozenset[str] | None = None  # the tenants with interactive decodes in the step, once asked
    shaping_decided: bool = False
    batch_floor_tokens: int = 0  # batch_min_share's tokens, which shaping never takes from batch
    batch_tokens: int = 0
    batch_tenants: set[str] = field(default_factory=set)  # the tenants with batch work in the step so far
    num_tokens: int = 0  # tokens the step computes so far

    def add(self, request: Request, num_new: int, block_table: tuple[int, ...] | None = None) -> None:
        """Schedule the request's next num_new tokens (a prefill chunk, a resume chunk or one decode), with
        its block table when the caller has it at hand. Called for every running request at every step:
        positional arguments, no property reads."""
        start = request.num_computed_tokens
        token_ids, sampling = request.token_ids, request.sampling
        needs_sample = start + num_new == len(token_ids)
        if block_table is None:
            block_table = self.blocks.block_table(request.request_id)
        sequence = ScheduledSequence(request.request_id, token_ids[start:start + num_new], start, block_table,
                                     needs_sample, sampling, lora_slot=request.lora_slot)
        if sampling.carries_tokens:
            self._attach_tokens(sequence, request)
        if needs_sample and request.publish_kv and start < request.num_prompt_tokens:
            hashes = request.prompt_block_hashes
            self.plan.publishes.append((hashes, block_table[:len(hashes)]))
        self.plan.sequences.append(sequence)
        self.tokens_left -= num_new
        self.num_tokens += num_new
        if request.priority is PriorityClass.BATCH:
            self.batch_tokens += num_new
            self.batch_tenants.add(request.tenant_id)

    def add_decodes(self, requests: list[Request], block_tables: list[tuple[int, ...]]) -> None:
        """`add(request, 1, table)` for interactive requests decoding one token each: the bulk of a busy
        step, built in one comprehension."""
        added = [ScheduledSequence(r.request_id, r.token_ids[-1:], r.num_computed_tokens, table, True, r.sampling,
                                   lora_slot=r.lora_slot)
                 for r, table in zip(requests, block_tables, strict=True)]
        for sequence, request in zip(added, requests, strict=True):
            if request.sampling.carries_tokens:
                self._attach_tokens(sequence, request)
        self.plan.sequences += added
        self.tokens_left -= len(added)
        self.num_tokens += len(added)

    @staticmethod
    def _attach_tokens(sequence: ScheduledSequence, request: Request) -> None:
        if sequence.needs_sample and request.sampling.needs_history:  # penalties and min_tokens read what came before
            sequence.prompt_token_ids = tuple(request.prompt_token_ids)
            sequence.output_token_ids = tuple(request.output_token_ids)
        elif request.sampling.prompt_logprobs is not None and sequence.start_position < request.num_prompt_tokens:
            sequence.prompt_token_ids = tuple(request.prompt_token_ids)  # the tokens its rows predict
