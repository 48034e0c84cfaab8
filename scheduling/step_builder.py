"""One step's plan as it is built: the sequences chosen so far and the tokens left in its budget."""

from __future__ import annotations

from dataclasses import dataclass

from gpu.plan import ScheduledSequence, StepPlan
from scheduling.request import Request


@dataclass(slots=True)
class StepBuilder:
    """The scheduler's phases each add to one builder; only `add` spends the token budget."""

    plan: StepPlan
    tokens_left: int  # of max_num_batched_tokens

    def add(self, request: Request, num_new: int) -> None:
        """Schedule the request's next num_new tokens (a prefill chunk, a resume chunk or one decode)."""
        start = request.num_computed_tokens
        needs_sample = start + num_new == request.num_tokens
        sequence = ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_ids[start:start + num_new],
            start_position=start,
            block_table=list(request.block_ids),
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
