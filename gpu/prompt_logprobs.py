"""Prompt log probabilities (completions' `echo` with `logprobs`): the model's raw log-softmax at
each prompt position, for the prompt token that follows it.

A prefill chunk normally keeps only the logits of its last token; for a request that asks, the
forward also keeps a row for every chunk position whose next token is still in the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.plan import ScheduledSequence, TokenLogprobs


@dataclass(slots=True, frozen=True)
class PromptRows:
    """The packed-batch rows whose logits predict prompt tokens, and what they predict."""

    rows: list[int]  # indices into the packed tokens of the step
    targets: list[int]  # the prompt token each row predicts
    owners: list[tuple[str, int, int, int]]  # (request id, first target position, first row, number of rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


def prompt_rows(sequences: Sequence[ScheduledSequence]) -> PromptRows:
    """For sequences in packed order (`decodes_first`)."""
    found = PromptRows([], [], [])
    offset = 0
    for seq in sequences:
        prompt = seq.prompt_token_ids
        if seq.sampling.prompt_logprobs is not None and seq.start_position + 1 < len(prompt):
            count = min(len(seq.token_ids), len(prompt) - 1 - seq.start_position)
            found.owners.append((seq.request_id, seq.start_position + 1, len(found.rows), count))
            found.rows.extend(range(offset, offset + count))
            found.targets.extend(prompt[seq.start_position + 1:seq.start_position + 1 + count])
        offset += len(seq.token_ids)
    return found


def prompt_logprobs(logits: torch.Tensor, found: PromptRows, sequences: Sequence[ScheduledSequence]
                    ) -> dict[str, tuple[int, tuple[TokenLogprobs, ...]]]:
    """logits: one row per entry of found.rows. One log_softmax, gather and topk for all."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(found.targets, dtype=torch.long, device=logits.device)
    picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k_of = {seq.request_id: seq.sampling.prompt_logprobs or 0 for seq in sequences}
    max_k = min(max(k_of[owner[0]] for owner in found.owners), logprobs.shape[-1])
    top = torch.topk(logprobs, max_k, dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    result = {}
    for request_id, first_position, first_row, count in found.owners:
        k = k_of[request_id]
        entries = tuple(TokenLogprobs(found.targets[row], picked[row],
                                      tuple(zip(top_ids[row][:k], top_values[row][:k], strict=True)))
                        for row in range(first_row, first_row + count))
        result[request_id] = (first_position, entries)
    return result
