"""One step's plan as it is built: the sequences chosen so far, the tokens left in its budget, and the
time left for shaped work."""

from __future__ import annotations

from dataclasses import dataclass

from gpu.plan import ScheduledSequence, StepPlan
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
    shaping_decided: bool = False
    batch_floor_tokens: int = 0  # batch_min_share's tokens, which shaping never takes from batch
    batch_tokens: int = 0

    def add(self, request: Request, num_new: int) -> None:
        """Schedule the request's next num_new tokens (a prefill chunk, a resume chunk or one decode)."""
        start = request.num_computed_tokens
        needs_sample = start + num_new == request.num_tokens
        sequence = ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_ids[start:start + num_new],
            start_position=start,
            block_table=self.blocks.block_table(request.request_id),
            needs_sample=needs_sample,
            sampling=request.sampling,
        )
        if needs_sample and request.sampling.needs_history:  # penalties and min_tokens read what came before
            sequence.prompt_token_ids = tuple(request.prompt_token_ids)
            sequence.output_token_ids = tuple(request.output_token_ids)
        elif request.sampling.prompt_logprobs is not None and start < request.num_prompt_tokens:
            sequence.prompt_token_ids = tuple(request.prompt_token_ids)  # the tokens its rows predict
        self.plan.sequences.append(sequence)
        self.tokens_left -= num_new
        if request.priority is PriorityClass.BATCH:
            self.batch_tokens += num_new
