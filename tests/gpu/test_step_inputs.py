"""Step tensors built with tensor ops agree with the plain per-token definition."""

from __future__ import annotations

import torch

from contract.plan import SamplingParams, ScheduledSequence
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.step_inputs import build_step_inputs, decodes_first

BLOCK_SIZE, KV_HEADS = 4, 2


def sequence(start: int, num_tokens: int, table: list[int], needs_sample: bool = True) -> ScheduledSequence:
    return ScheduledSequence(f"r{start}-{num_tokens}", list(range(100, 100 + num_tokens)), start, tuple(table),
                             needs_sample, SamplingParams())


def test_positions_rows_and_sampled_indices_follow_each_sequence() -> None:
    cache = PagedKVCache(KVShape(1, KV_HEADS, 8, BLOCK_SIZE, torch.float32), 32, 0, torch.device("cpu"))
    sequences = decodes_first([
        sequence(0, 6, [3, 9]),  # a fresh prompt over two blocks
        sequence(9, 1, [1, 5, 7]),  # a decode at position 9: third block, offset 1
        sequence(5, 3, [2, 4], needs_sample=False),  # a middle chunk of a longer prompt
        sequence(2, 1, [8]),
    ])
    step = build_step_inputs(sequences, cache)
    expected_positions = [p for s in sequences for p in range(s.start_position, s.start_position + len(s.token_ids))]
    assert step.positions[0].tolist() == expected_positions
    assert step.input_ids[0].tolist() == [t for s in sequences for t in s.token_ids]
    slots = [(s.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE) for s in sequences
             for p in range(s.start_position, s.start_position + len(s.token_ids))]
    expected_rows = [(block * KV_HEADS + head) * BLOCK_SIZE + offset for head in range(KV_HEADS)
                     for block, offset in slots]
    assert step.metadata.write_rows.tolist() == expected_rows
    ends = torch.cumsum(torch.tensor([len(s.token_ids) for s in sequences]), 0)
    assert step.logits_indices.tolist() == [int(e) - 1 for s, e in zip(sequences, ends, strict=True) if s.needs_sample]
    assert step.metadata.num_decodes == 2
    assert step.metadata.max_decode_context == 3 * BLOCK_SIZE  # the longest decode context, in whole blocks
    assert step.metadata.decode_bias is not None
    visible = torch.eq(step.metadata.decode_bias, 0).reshape(2, -1).sum(dim=1).tolist()
    assert visible == [10, 3]  # positions 0..9 and 0..2
