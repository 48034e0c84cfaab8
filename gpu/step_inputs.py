"""A step's tensors, built with a handful of tensor ops instead of per-token Python loops.

The runner packs a step as `[1, total_tokens]`: single-token sequences (decodes) first, then
multi-token chunks. Everything per token (positions, the slot each new K/V goes to) is derived on
the device from per-sequence numbers; per-sequence Python work is one padded block table. The pool
is head-major within a block (see gpu.attention), so the rows written and read are per (block, head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from gpu.attention import PagedMetadata, PrefillChunk
from gpu.kv_cache import PagedKVCache
from gpu.plan import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    """What the model forward takes for one step."""

    input_ids: torch.Tensor  # [1, total_tokens]
    positions: torch.Tensor  # [1, total_tokens]
    logits_indices: torch.Tensor  # index in the packed batch of each sampled sequence's last token
    metadata: PagedMetadata


def decodes_first(sequences: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
    """The packed layout the attention expects: single-token sequences, then multi-token chunks."""
    return sorted(sequences, key=lambda s: len(s.token_ids) > 1)


def padded_block_tables(sequences: Sequence[ScheduledSequence], device: torch.device) -> torch.Tensor:
    """[sequences, widest table] block ids; the padding (block 0) is never read unmasked."""
    width = max(len(s.block_table) for s in sequences)
    rows = [[*s.block_table, *[0] * (width - len(s.block_table))] for s in sequences]
    return torch.tensor(rows, dtype=torch.long, device=device)


def build_step_inputs(sequences: Sequence[ScheduledSequence], cache: PagedKVCache) -> StepInputs:
    """Sequences must be in `decodes_first` order."""
    device, block_size = cache.device, cache.shape.block_size
    query_lens = torch.tensor([len(s.token_ids) for s in sequences], device=device)
    starts = torch.tensor([s.start_position for s in sequences], device=device)
    ends = torch.cumsum(query_lens, 0)
    total = int(ends[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(sequences), device=device), query_lens, output_size=total)
    positions = starts[seq_of_token] + torch.arange(total, device=device) - (ends - query_lens)[seq_of_token]
    tables = padded_block_tables(sequences, device)
    blocks = tables[seq_of_token, positions // block_size]
    # [kv_heads, total_tokens]: each token's (block, head) row, then its offset inside that row
    write_rows = context_rows(blocks, cache.shape.num_kv_heads) * block_size + positions % block_size
    input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in sequences)), dtype=torch.long,
                             device=device)
    sampled = torch.tensor([s.needs_sample for s in sequences], dtype=torch.bool, device=device)
    metadata = _paged_metadata(sequences, cache, tables, write_rows.reshape(-1))
    return StepInputs(input_ids[None], positions[None], (ends - 1)[sampled], metadata)


def _paged_metadata(sequences: Sequence[ScheduledSequence], cache: PagedKVCache, tables: torch.Tensor,
                    write_rows: torch.Tensor) -> PagedMetadata:
    num_decodes = sum(1 for s in sequences if len(s.token_ids) == 1)
    meta = PagedMetadata(cache, write_rows, num_decodes)
    if num_decodes:
        _add_decode_layout(meta, sequences[:num_decodes], tables[:num_decodes], cache)
    query_start = num_decodes
    for row, seq in enumerate(sequences[num_decodes:], start=num_decodes):
        meta.prefills.append(_prefill_chunk(seq, tables[row], query_start, cache))
        query_start += len(seq.token_ids)
    return meta


def context_rows(blocks: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., kv_heads, blocks] pool rows (one per block and head) of the blocks [..., blocks], head-major."""
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None]
    return blocks.unsqueeze(-2) * num_kv_heads + heads


def _add_decode_layout(meta: PagedMetadata, decodes: Sequence[ScheduledSequence], tables: torch.Tensor,
                       cache: PagedKVCache) -> None:
    """Whole blocks of every decode's context, padded to the longest, and the bias that hides the padding."""
    block_size = cache.shape.block_size
    lengths = torch.tensor([s.start_position + 1 for s in decodes], device=tables.device)
    num_blocks = -(-int(lengths.max()) // block_size)
    meta.decode_rows = context_rows(tables[:, :num_blocks], cache.shape.num_kv_heads).reshape(-1)
    keys = torch.arange(num_blocks * block_size, device=tables.device)
    hidden = (keys[None, :] >= lengths[:, None])[:, None, None, :]
    meta.decode_bias = torch.zeros(hidden.shape, device=tables.device).masked_fill(hidden, float("-inf"))
    meta.max_decode_context = num_blocks * block_size


def _prefill_chunk(seq: ScheduledSequence, table: torch.Tensor, query_start: int, cache: PagedKVCache
                   ) -> PrefillChunk:
    num_queries = len(seq.token_ids)
    if seq.start_position == 0:  # a fresh prompt: the chunk is all its context, plainly causal
        return PrefillChunk(query_start, num_queries, num_queries, None, None)
    context_len = seq.start_position + num_queries
    device = table.device
    blocks = table[: -(-context_len // cache.shape.block_size)]
    query_positions = seq.start_position + torch.arange(num_queries, device=device)
    mask = torch.arange(context_len, device=device)[None, :] <= query_positions[:, None]
    return PrefillChunk(query_start, num_queries, context_len,
                        context_rows(blocks, cache.shape.num_kv_heads).reshape(-1), mask)
