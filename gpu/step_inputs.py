"""A step's tensors, built with a handful of tensor ops instead of per-token Python loops.

The runner packs a step as `[1, total_tokens]`: single-token sequences (decodes) first, then
multi-token chunks. Everything per token (positions, the slot each new K/V goes to) is derived on
the device from per-sequence numbers; per-sequence Python work is one padded block table. The pool
is head-major within a block (see gpu.attention), so the rows written and read are per (block, head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from contract.plan import ScheduledSequence
from gpu.attention import FRESH_PROMPT, PagedMetadata
from gpu.kv_cache import PagedKVCache


@dataclass(slots=True)
class StepInputs:
    """What the model forward takes for one step."""

    input_ids: torch.Tensor  # [1, total_tokens]
    positions: torch.Tensor  # [1, total_tokens]
    logits_indices: torch.Tensor  # index in the packed batch of each sampled sequence's last token (and proposals)
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
    # Sizes and indices that Python needs come from the plan: reading them off `ends` would wait on the device.
    host_ends = list(accumulate(len(s.token_ids) for s in sequences))
    total = host_ends[-1]
    seq_of_token = torch.repeat_interleave(torch.arange(len(sequences), device=device), query_lens, output_size=total)
    positions = starts[seq_of_token] + torch.arange(total, device=device) - (ends - query_lens)[seq_of_token]
    tables = padded_block_tables(sequences, device)
    blocks = tables[seq_of_token, positions // block_size]
    # [kv_heads, total_tokens]: each token's (block, head) row, then its offset inside that row
    write_rows = context_rows(blocks, cache.shape.num_kv_heads) * block_size + positions % block_size
    input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in sequences)), dtype=torch.long,
                             device=device)
    # A sampled sequence's last token, and before it one row per proposed token it verifies.
    sampled = torch.tensor([row for end, s in zip(host_ends, sequences, strict=True) if s.needs_sample
                            for row in range(end - 1 - s.num_draft_tokens, end)], dtype=torch.long, device=device)
    metadata = _paged_metadata(sequences, cache, tables, write_rows.reshape(-1))
    return StepInputs(input_ids[None], positions[None], sampled, metadata)


def _paged_metadata(sequences: Sequence[ScheduledSequence], cache: PagedKVCache, tables: torch.Tensor,
                    write_rows: torch.Tensor) -> PagedMetadata:
    num_decodes = sum(1 for s in sequences if len(s.token_ids) == 1)
    decode_rows, decode_bias, decode_lengths = _decode_layout(sequences[:num_decodes], tables[:num_decodes], cache)
    layout, prefill_rows = _prefill_layout(sequences[num_decodes:], tables[num_decodes:], num_decodes, cache)
    buffer_shape = (decode_rows.shape[0], cache.shape.block_size, cache.shape.head_dim)
    pool_dtype, compute_dtype = cache.shape.dtype, cache.shape.compute_dtype or cache.shape.dtype
    staging_shape = buffer_shape if pool_dtype != compute_dtype else (0, *buffer_shape[1:])
    return PagedMetadata(
        kv_pool=cache.device_pool, write_rows=write_rows, decode_rows=decode_rows, decode_bias=decode_bias,
        decode_lengths=decode_lengths,
        decode_keys=torch.empty(buffer_shape, dtype=compute_dtype, device=cache.device),
        decode_values=torch.empty(buffer_shape, dtype=compute_dtype, device=cache.device),
        decode_staging=torch.empty(staging_shape, dtype=pool_dtype, device=cache.device),
        prefill_layout=layout, prefill_rows=prefill_rows)


def context_rows(blocks: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., kv_heads, blocks] pool rows (one per block and head) of the blocks [..., blocks], head-major."""
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None]
    return blocks.unsqueeze(-2) * num_kv_heads + heads


def _decode_layout(decodes: Sequence[ScheduledSequence], tables: torch.Tensor, cache: PagedKVCache
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole blocks of every decode's context, padded to the longest, the bias that hides the padding, and
    each decode's context length."""
    device, block_size = tables.device, cache.shape.block_size
    if not decodes:  # one block wide all the same: a zero there gives the bias other strides than a
        # non-empty one has, and a compiled graph may guard on strides
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, torch.zeros((0, 1, 1, block_size), device=device), empty.clone()
    lengths = torch.tensor([s.start_position + 1 for s in decodes], device=device)
    num_blocks = -(-max(s.start_position + 1 for s in decodes) // block_size)  # from the plan, not the device
    rows = context_rows(tables[:, :num_blocks], cache.shape.num_kv_heads).reshape(-1)
    keys = torch.arange(num_blocks * block_size, device=device)
    hidden = (keys[None, :] >= lengths[:, None])[:, None, None, :]
    return rows, torch.zeros(hidden.shape, device=device).masked_fill(hidden, float("-inf")), lengths


def _prefill_layout(chunks: Sequence[ScheduledSequence], tables: torch.Tensor, query_start: int,
                    cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's row of PagedMetadata.prefill_layout (on the CPU: the op reads it as numbers), and the
    context rows of the chunks that continue a cached context, concatenated."""
    layout: list[list[int]] = []
    rows: list[torch.Tensor] = []
    num_rows = 0
    for seq, table in zip(chunks, tables, strict=True):
        num_queries = len(seq.token_ids)
        context_len = seq.start_position + num_queries
        if seq.start_position == 0:  # a fresh prompt: the chunk is all its context
            layout.append([query_start, num_queries, context_len, FRESH_PROMPT])
        else:
            blocks = table[: -(-context_len // cache.shape.block_size)]
            rows.append(context_rows(blocks, cache.shape.num_kv_heads).reshape(-1))
            layout.append([query_start, num_queries, context_len, num_rows])
            num_rows += rows[-1].shape[0]
        query_start += num_queries
    concatenated = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=tables.device)
    return torch.tensor(layout, dtype=torch.long).reshape(-1, 4), concatenated
