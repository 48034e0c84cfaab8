"""The plain-data contract between the scheduler and the model runner.

Torch-free on purpose: the scheduler builds a `StepPlan`, the runner executes it and answers with
a `StepResult`. Both sides import only this module of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its next token."""

    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1 keeps everything
    top_k: int = 0  # tokens kept by rank; 0 keeps everything
    seed: int | None = None  # a per-request generator: same tokens whatever shares the batch

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: a prefill chunk, a resume chunk or a single decode token."""

    request_id: str
    token_ids: list[int]  # the tokens fed this step, at positions start_position onward
    start_position: int  # tokens before this one already have their K/V in the cache
    block_table: list[int]  # device block ids covering positions [0, start_position + len(token_ids))
    needs_sample: bool  # True when this chunk reaches the end of the known tokens
    sampling: SamplingParams


@dataclass(slots=True)
class StepPlan:
    """Everything the runner does in one step, in order: swap out, swap in, forward, sample."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not (self.sequences or self.swap_out or self.swap_in or self.finished_request_ids)


@dataclass(slots=True)
class StepResult:
    """What one step produced."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    forward_seconds: float = 0.0  # time inside the model forward (for forward_fraction)
    swap_seconds: float = 0.0  # time spent copying blocks between device and CPU


@dataclass(slots=True, frozen=True)
class CacheGeometry:
    """The shape of the KV memory, reported by the runner so the scheduler can count blocks."""

    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
