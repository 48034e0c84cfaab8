"""Timed steps that fit the step cost model before the first request, so a fresh server shapes as a warm one.

Step shaping predicts a step's time with the cost model (scheduling/step_cost.py). Fitted online only, a
fresh server shapes nothing for its first steps, and then predicts from what it happened to see first: a
server whose first traffic was a batch flood had seen only full 512-token steps, and extrapolated from
them to the small steps it shapes. Before its first step (and again when the runner changes its forward,
the eager one for the compiled one) the engine runs these steps, each kind the shaper weighs: decodes
alone at eight batch sizes, prompt chunks of three lengths, a chunk that continues a long context, and
decodes beside a chunk. Each runs twice, and its quicker time anchors every later fit (the first run
at a shape may pay once for what later steps find ready, scheduling/step_cost.py).

The steps compute over free device blocks the scheduler takes from its pool for the step and gives back
right after (their contents are junk, never entered in the prefix cache). A step that does not fit the
sequence cap or the free blocks is left out; a chunk longer than the token budget is cut to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from contract.plan import SamplingParams, ScheduledSequence, StepPlan
from scheduling.block_manager import KVBlockManager

REPEATS = 2
DECODE_CONTEXT = 128  # tokens before each calibration decode


@dataclass(slots=True, frozen=True)
class StepShape:
    num_decodes: int = 0  # each at DECODE_CONTEXT
    chunk_tokens: int = 0  # one prompt chunk, from chunk_start
    chunk_start: int = 0


SHAPES = (
    # Decodes alone at every few row counts: the small steps whose kernels change with each few rows, where
    # speculative decoding weighs each proposed row (scheduling/speculation.py).
    StepShape(num_decodes=1), StepShape(num_decodes=2), StepShape(num_decodes=3), StepShape(num_decodes=4),
    StepShape(num_decodes=6), StepShape(num_decodes=8), StepShape(num_decodes=12), StepShape(num_decodes=16),
    StepShape(chunk_tokens=16), StepShape(chunk_tokens=64), StepShape(chunk_tokens=256),
    StepShape(chunk_tokens=64, chunk_start=256), StepShape(num_decodes=4, chunk_tokens=64),
)
# What the derived ITL target and the arrival budget are multiples of (scheduling/step_shaper.py): timed on its
# own, between served steps, when the forward changed under load (a lone decode may not be served for minutes).
LONE_DECODE = (StepShape(num_decodes=1),)


def calibration_plans(blocks: KVBlockManager, max_tokens: int, max_seqs: int,
                      shapes: tuple[StepShape, ...] = SHAPES) -> Iterator[StepPlan]:
    """Each calibration step of `shapes` that fits, REPEATS times; the blocks of a plan are the scheduler's
    again once the caller asks for the next (or closes the iterator)."""
    number = 0
    for shape in _fitting(max_tokens, max_seqs, shapes):
        for _ in range(REPEATS):
            taken = _take_blocks(blocks, shape)
            if taken is None:
                break
            try:
                yield StepPlan(sequences=_sequences(shape, taken, blocks.block_size, number))
            finally:
                blocks.device.free(taken)
            number += 1


def _fitting(max_tokens: int, max_seqs: int, candidates: tuple[StepShape, ...]) -> list[StepShape]:
    """The shapes within the step's caps, the longest chunk cut to the token budget (the longest step
    served), each once."""
    shapes: list[StepShape] = []
    for shape in candidates:
        chunk = min(shape.chunk_tokens, max_tokens - shape.num_decodes)
        fitted = StepShape(shape.num_decodes, chunk, shape.chunk_start)
        if chunk < 0 or shape.num_decodes + bool(chunk) > max_seqs or fitted in shapes:
            continue
        shapes.append(fitted)
    return shapes


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _take_blocks(blocks: KVBlockManager, shape: StepShape) -> list[int] | None:
    needed = (shape.num_decodes * _blocks_for(DECODE_CONTEXT + 1, blocks.block_size)
              + _blocks_for(shape.chunk_start + shape.chunk_tokens, blocks.block_size))
    return blocks.device.allocate(needed)


def _sequences(shape: StepShape, taken: list[int], block_size: int, number: int) -> list[ScheduledSequence]:
    free = iter(taken)
    sequences = []
    for index in range(shape.num_decodes):
        table = tuple(next(free) for _ in range(_blocks_for(DECODE_CONTEXT + 1, block_size)))
        sequences.append(ScheduledSequence(f"calibration-{number}-{index}", [1], DECODE_CONTEXT, table, True,
                                           SamplingParams()))
    if shape.chunk_tokens:
        end = shape.chunk_start + shape.chunk_tokens
        table = tuple(next(free) for _ in range(_blocks_for(end, block_size)))
        sequences.append(ScheduledSequence(f"calibration-{number}-chunk", [1] * shape.chunk_tokens,
                                           shape.chunk_start, table, True, SamplingParams()))
    return sequences
