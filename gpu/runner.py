"""The model runner: executes a `StepPlan` (swaps, one packed forward, sampling) -> `StepResult`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.attention import ATTENTION_NAME, PagedMetadata, PrefillChunk
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.models import LoadedModel
from gpu.plan import CacheGeometry, ScheduledSequence, StepPlan, StepResult
from gpu.sampler import Sampler


@dataclass(slots=True, frozen=True)
class RunnerBudget:
    """The memory the runner may take, in bytes, and the block size."""

    block_size: int
    kv_cache_bytes: int
    swap_space_bytes: int
    max_model_len: int | None = None
    seed: int = 0


def kv_shape_of(loaded: LoadedModel, block_size: int) -> KVShape:
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVShape(config.num_hidden_layers, kv_heads, head_dim, block_size, loaded.dtype)


class ModelRunner:
    """Owns the model, the KV pools and the sampler. Called from one worker thread only."""

    def __init__(self, loaded: LoadedModel, budget: RunnerBudget) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.device = loaded.device
        shape = kv_shape_of(loaded, budget.block_size)
        self.block_size = budget.block_size
        self.cache = PagedKVCache(shape, budget.kv_cache_bytes // shape.bytes_per_block,
                                  budget.swap_space_bytes // shape.bytes_per_block, self.device)
        self.sampler = Sampler(self.device, budget.seed)
        max_len = min(loaded.max_model_len, budget.max_model_len or loaded.max_model_len)
        self._geometry = CacheGeometry(self.cache.num_device_blocks, self.cache.num_cpu_blocks,
                                       budget.block_size, shape.bytes_per_block, max_len)

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def execute(self, plan: StepPlan) -> StepResult:
        swap_started = time.perf_counter()
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        result = StepResult(swap_seconds=time.perf_counter() - swap_started)
        self.sampler.forget(plan.finished_request_ids)
        if not plan.sequences:
            return result
        ordered = decodes_first(plan.sequences)
        forward_started = time.perf_counter()
        logits = self.compute_logits(ordered)
        result.forward_seconds = time.perf_counter() - forward_started
        sampling = [seq for seq in ordered if seq.needs_sample]
        if sampling:
            tokens = self.sampler.sample(logits, [s.sampling for s in sampling], [s.request_id for s in sampling])
            result.sampled_token_ids = {s.request_id: t for s, t in zip(sampling, tokens, strict=True)}
        return result

    @torch.inference_mode()
    def compute_logits(self, sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
        """One packed forward. Returns float32 logits, one row per sequence that needs a sample,
        in the order given. Sequences of one token must come first (see `decodes_first`)."""
        input_ids, positions, keep = packed_inputs(sequences, self.device)
        meta = self._metadata(sequences)
        output = self.model(input_ids=input_ids, position_ids=positions, logits_to_keep=keep,
                            use_cache=False, paged_metadata=meta)
        logits: torch.Tensor = output.logits[0].float()
        return logits

    def _metadata(self, sequences: Sequence[ScheduledSequence]) -> PagedMetadata:
        num_decodes = sum(1 for s in sequences if len(s.token_ids) == 1)
        decode_slots, decode_mask, max_ctx = self._decode_layout(sequences[:num_decodes])
        meta = PagedMetadata(self.cache, self._slot_mapping(sequences), num_decodes, decode_slots,
                             decode_mask, max_ctx)
        query_start = num_decodes
        for seq in sequences[num_decodes:]:
            meta.prefills.append(self._prefill_chunk(seq, query_start))
            query_start += len(seq.token_ids)
        return meta

    def _slot_mapping(self, sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
        bs = self.block_size
        slots = [
            seq.block_table[pos // bs] * bs + pos % bs
            for seq in sequences
            for pos in range(seq.start_position, seq.start_position + len(seq.token_ids))
        ]
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _context_slots(self, block_tables: list[list[int]], context_len: int) -> torch.Tensor:
        """[len(block_tables), context_len] slot of every context position through each block table."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], device=self.device)
        positions = torch.arange(context_len, device=self.device)
        return tables[:, positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_layout(self, decodes: Sequence[ScheduledSequence]
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        if not decodes:
            return None, None, 0
        lengths = torch.tensor([s.start_position + 1 for s in decodes], device=self.device)
        max_ctx = int(lengths.max())
        slots = self._context_slots([s.block_table for s in decodes], max_ctx)
        mask = torch.arange(max_ctx, device=self.device)[None, :] < lengths[:, None]
        return slots.reshape(-1), mask[:, None, None, :], max_ctx

    def _prefill_chunk(self, seq: ScheduledSequence, query_start: int) -> PrefillChunk:
        num_queries = len(seq.token_ids)
        if seq.start_position == 0:
            return PrefillChunk(query_start, num_queries, num_queries, None, None)
        context_len = seq.start_position + num_queries
        slots = self._context_slots([seq.block_table], context_len)[0]
        query_positions = seq.start_position + torch.arange(num_queries, device=self.device)
        mask = torch.arange(context_len, device=self.device)[None, :] <= query_positions[:, None]
        return PrefillChunk(query_start, num_queries, context_len, slots, mask)


def decodes_first(sequences: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
    """The packed layout the attention expects: single-token sequences, then multi-token chunks."""
    return sorted(sequences, key=lambda s: len(s.token_ids) > 1)


def packed_inputs(sequences: Sequence[ScheduledSequence], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids and positions as [1, total_tokens], and the index of each sampled sequence's last token."""
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    for seq in sequences:
        ids.extend(seq.token_ids)
        positions.extend(range(seq.start_position, seq.start_position + len(seq.token_ids)))
        if seq.needs_sample:
            keep.append(len(ids) - 1)
    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return as_tensor(ids)[None], as_tensor(positions)[None], as_tensor(keep)
