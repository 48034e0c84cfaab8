"""Speculative decoding's draft model: a smaller model with the same tokenizer, run by the same runner on a
KV pool of its own, proposes the tokens the next step verifies.

After a step, each sampled sequence the scheduler asked proposals for (`num_proposals_wanted`) gets them:
the draft first reads what it has not read of the request's tokens (a prompt chunk, or the tokens the last
verification accepted and the one after them), then decodes greedily, one token per forward for all the
sequences together. Its KV blocks are its own (a free list over its pool, per request), never the target's:
a preemption, a swap or a prefix-cache hit on the target side leaves them valid, because the tokens they
hold are the request's own; where the draft has not read a token (a prompt served from the prefix cache),
it reads it now from the tokens the sequence carries. The proposals' own positions are written and never
counted: the next read overwrites them. A request the pool has no room for gets no proposal this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from contract.plan import SamplingParams, ScheduledSequence
from gpu.attention import ATTENTION_NAME
from gpu.compiled import PackedForward
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.models import LoadedModel
from gpu.step_inputs import build_step_inputs, decodes_first

GREEDY = SamplingParams()


@dataclass(slots=True)
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    num_read: int = 0  # the request's first tokens whose K/V the draft's pool holds


class DraftProposer:
    """Proposes with `loaded`, eagerly, over a pool of `num_blocks` blocks. Called from the runner's thread."""

    def __init__(self, loaded: LoadedModel, shape: KVShape, num_blocks: int) -> None:
        loaded.model.set_attn_implementation(ATTENTION_NAME)
        self.cache = PagedKVCache(shape, num_blocks, 0, loaded.device)
        self.forward = PackedForward(loaded.model, "eager")
        self.block_size = shape.block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}

    @property
    def request_ids(self) -> frozenset[str]:
        """The requests holding draft blocks (for tests and stats)."""
        return frozenset(self._states)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                self._free += state.blocks

    def propose(self, wanted: Sequence[tuple[str, list[int], int]]) -> dict[str, tuple[int, ...]]:
        """(request id, its tokens now, how many to propose) -> the proposals of each that fit the pool."""
        fitting = [(request_id, tokens, k) for request_id, tokens, k in wanted
                   if self._room(request_id, len(tokens) + k - 1)]
        if not fitting:
            return {}
        proposals: dict[str, list[int]] = {request_id: [] for request_id, _, _ in fitting}
        sequences = []
        for request_id, tokens, _ in fitting:
            state = self._states[request_id]
            start = min(state.num_read, len(tokens) - 1)  # the last token is always read again: its logits
            sequences.append(self._sequence(request_id, tokens[start:], start))
            state.num_read = len(tokens)
        positions = {request_id: len(tokens) for request_id, tokens, _ in fitting}
        for step in range(max(k for _, _, k in fitting)):
            for seq, token in zip(sequences, self._greedy(sequences), strict=True):
                proposals[seq.request_id].append(token)
            sequences = [self._sequence(request_id, [proposals[request_id][-1]], positions[request_id] + step)
                         for request_id, _, k in fitting if k > step + 1]
            if not sequences:
                break
        return {request_id: tuple(proposals[request_id][:k]) for request_id, _, k in fitting}

    def _sequence(self, request_id: str, token_ids: list[int], start: int) -> ScheduledSequence:
        return ScheduledSequence(request_id, token_ids, start, tuple(self._states[request_id].blocks), True, GREEDY)

    @torch.inference_mode()
    def _greedy(self, sequences: list[ScheduledSequence]) -> list[int]:
        """Each sequence's next token, in the order given."""
        ordered = decodes_first(sequences)
        step = build_step_inputs(ordered, self.cache)
        tokens = torch.argmax(self.forward(step, step.logits_indices), dim=-1).tolist()
        by_id = {seq.request_id: token for seq, token in zip(ordered, tokens, strict=True)}
        return [by_id[seq.request_id] for seq in sequences]

    def _room(self, request_id: str, last_position: int) -> bool:
        """Blocks for positions up to last_position; False, and the request's blocks given back, when the
        pool has too few (it reads everything again when it next fits)."""
        state = self._states.setdefault(request_id, _DraftState())
        needed = last_position // self.block_size + 1 - len(state.blocks)
        if needed > len(self._free):
            self.forget([request_id])
            return False
        for _ in range(max(0, needed)):
            state.blocks.append(self._free.pop())
        return True
