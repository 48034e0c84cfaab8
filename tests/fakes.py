"""Test doubles for the executor side of the engine. Nothing here imports torch.

`FakeExecutor` stands in for the model runner: its tokens are a pure function of the request id
and the position, so a request's output never depends on batching, chunking or preemption, and
each step advances a virtual clock by a known cost per token instead of taking real time.
`RecordingExecutor` wraps a real executor and keeps every plan it ran, so a test can check that
the path it meant to exercise (a chunked prefill, a mixed step) was actually taken.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from gpu.plan import CacheGeometry, ScheduledSequence, StepPlan, StepResult
from scheduling.executor import Executor


@dataclass(slots=True, frozen=True)
class TokenCosts:
    """The virtual time a step costs, in seconds."""

    prefill_token: float = 0.0001  # per prompt (or recompute) token fed
    decode_token: float = 0.002  # per decode token: one sequence, one token, sampled
    step: float = 0.0  # fixed per non-empty step


@dataclass(slots=True)
class TokenTally:
    """What an executor has been asked to compute so far."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    tokens_by_request: dict[str, int] = field(default_factory=dict)  # tokens fed, per request id


def is_decode(seq: ScheduledSequence) -> bool:
    """A single sampled token. (A one-token prompt looks the same, and costs the same.)"""
    return len(seq.token_ids) == 1 and seq.needs_sample


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    """The token FakeExecutor samples for request_id at position: stable across runs and processes."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % vocab_size


class FakeExecutor:
    """Satisfies `scheduling.executor.Executor` without a model: deterministic tokens, virtual time."""

    def __init__(self, geometry: CacheGeometry, costs: TokenCosts | None = None, vocab_size: int = 320) -> None:
        self._geometry = geometry
        self.costs = costs or TokenCosts()
        self.vocab_size = vocab_size
        self.clock = 0.0  # virtual seconds spent in all steps so far
        self.tally = TokenTally()
        self.plans: list[StepPlan] = []

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def token_for(self, request_id: str, position: int) -> int:
        return fake_token(request_id, position, self.vocab_size)

    def step_cost(self, plan: StepPlan) -> float:
        if not plan.sequences:
            return 0.0
        num_decode = sum(1 for seq in plan.sequences if is_decode(seq))
        num_prefill = plan.num_tokens - num_decode
        return self.costs.step + num_prefill * self.costs.prefill_token + num_decode * self.costs.decode_token

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        cost = self.step_cost(plan)
        self.clock += cost
        self._count(plan)
        sampled = {
            seq.request_id: self.token_for(seq.request_id, seq.start_position + len(seq.token_ids))
            for seq in plan.sequences
            if seq.needs_sample
        }
        return StepResult(sampled_token_ids=sampled, forward_seconds=cost)

    def _count(self, plan: StepPlan) -> None:
        if not plan.sequences:
            return
        self.tally.num_steps += 1
        for seq in plan.sequences:
            if is_decode(seq):
                self.tally.num_decode_tokens += 1
            else:
                self.tally.num_prefill_tokens += len(seq.token_ids)
            previous = self.tally.tokens_by_request.get(seq.request_id, 0)
            self.tally.tokens_by_request[seq.request_id] = previous + len(seq.token_ids)


class RecordingExecutor:
    """Delegates to another executor and keeps each plan it ran."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    @property
    def geometry(self) -> CacheGeometry:
        return self.inner.geometry

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self.inner.execute(plan)


class FailingExecutor:
    """Raises on the step numbered fail_at (1-based); until then behaves like a FakeExecutor."""

    def __init__(self, geometry: CacheGeometry, fail_at: int = 1) -> None:
        self.inner = FakeExecutor(geometry)
        self.fail_at = fail_at
        self.num_calls = 0

    @property
    def geometry(self) -> CacheGeometry:
        return self.inner.geometry

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_calls += 1
        if self.num_calls >= self.fail_at:
            raise RuntimeError("injected executor failure")
        return self.inner.execute(plan)
