"""Executors without a model, shared by the tests and the benchmarks. Nothing here imports torch.

Each satisfies `scheduling.executor.Executor`:
- `FakeExecutor` stands in for the model runner when what matters is the schedule: its tokens are a
  pure function of the request id and the position, so a request's output never depends on batching,
  chunking or preemption, and each step advances a virtual clock by a cost model (`TokenCosts` per
  prefill and decode token, or `LinearStepCost` per token fed) instead of taking real time.
- `InstantExecutor` costs nothing and samples the bytes of a fixed UTF-8 script, so with a byte-level
  tokenizer the output is known, readable text: what the HTTP tests and `fairlane bench stream` read.
- `RecordingExecutor` wraps another and keeps every plan it ran; `FailingExecutor` raises on a chosen step.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from config.settings import Settings
from contract.plan import CacheGeometry, ScheduledSequence, StepPlan, StepResult, StructuredOutput
from scheduling.executor import Executor
from tenancy.vtc import ServiceWeights

# ---- cost models ---------------------------------------------------------------------------------


class StepCostModel(Protocol):
    def seconds(self, plan: StepPlan) -> float:
        """The virtual seconds a step takes; 0 for a plan with no sequences."""
        ...


def sequence_service(seq: ScheduledSequence, num_prompt_tokens: int, weights: ServiceWeights) -> float:
    """A sequence's unweighted service in a step, as VTC counts it: w_p per prompt token it computes, w_q
    for the token it samples (the benchmarks' measure of what each tenant received)."""
    prompt_end = min(seq.start_position + len(seq.token_ids), num_prompt_tokens)
    return weights.prompt * max(0, prompt_end - seq.start_position) + weights.decode * seq.needs_sample


def is_decode(seq: ScheduledSequence) -> bool:
    """A single sampled token. (A one-token prompt looks the same, and costs the same.)"""
    return len(seq.token_ids) == 1 and seq.needs_sample


@dataclass(slots=True, frozen=True)
class TokenCosts:
    """Prefill and decode tokens priced apart, in seconds."""

    prefill_token: float = 0.0001  # per prompt (or recompute) token fed
    decode_token: float = 0.002  # per decode token: one sequence, one token, sampled
    step: float = 0.0  # fixed per non-empty step

    def seconds(self, plan: StepPlan) -> float:
        if not plan.sequences:
            return 0.0
        num_decode = sum(1 for seq in plan.sequences if is_decode(seq))
        num_prefill = plan.num_tokens - num_decode
        return self.step + num_prefill * self.prefill_token + num_decode * self.decode_token


@dataclass(slots=True, frozen=True)
class LinearStepCost:
    """A fixed overhead plus one cost per token fed, prefill or decode alike, in seconds."""

    overhead_s: float = 0.005
    per_token_s: float = 0.0001

    def seconds(self, plan: StepPlan) -> float:
        return self.overhead_s + self.per_token_s * plan.num_tokens if plan.sequences else 0.0


def verify_greedily(seq: ScheduledSequence, token_at: Callable[[int], int]) -> tuple[int, ...]:
    """What greedy verification emits for a sequence with proposals when the executor would sample
    token_at(i) as the i-th token after the fed one (asked in order): the proposals while they are those
    tokens, then the first that differs or the one after them all. The output never depends on speculation."""
    emitted: list[int] = []
    for offset, draft in enumerate(seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:]):
        emitted.append(token_at(offset))
        if emitted[-1] != draft:
            return tuple(emitted)
    return (*emitted, token_at(seq.num_draft_tokens))


# ---- the deterministic executor ------------------------------------------------------------------


@dataclass(slots=True)
class TokenTally:
    """What an executor has been asked to compute so far."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    tokens_by_request: dict[str, int] = field(default_factory=dict)  # tokens fed, per request id


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    """The token FakeExecutor samples for request_id at position: stable across runs and processes."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % vocab_size


class FakeExecutor:
    """Deterministic tokens and a virtual clock: `clock` is the sum of every step's cost so far."""

    def __init__(self, geometry: CacheGeometry, costs: StepCostModel | None = None, vocab_size: int = 320,
                 keep_plans: bool = True) -> None:
        self._geometry = geometry
        self.costs: StepCostModel = costs or TokenCosts()
        self.vocab_size = vocab_size
        self.clock = 0.0  # virtual seconds spent in all steps so far
        self.tally = TokenTally()
        # Every plan run, for tests to read; a long benchmark turns it off (they would pile up for the
        # garbage collector to walk, and its pauses would be timed as the scheduler's).
        self.keep_plans = keep_plans
        self.plans: list[StepPlan] = []

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def token_for(self, request_id: str, position: int) -> int:
        return fake_token(request_id, position, self.vocab_size)

    def check_structured(self, structured: StructuredOutput) -> None:
        """A fake samples no grammar: it accepts every one."""

    def execute(self, plan: StepPlan) -> StepResult:
        if self.keep_plans:
            self.plans.append(plan)
        cost = self.costs.seconds(plan)
        self.clock += cost
        self._count(plan)
        sampled = {
            seq.request_id: self.token_for(seq.request_id, seq.start_position + len(seq.token_ids))
            for seq in plan.sequences
            if seq.needs_sample and not seq.num_draft_tokens
        }
        verified = {seq.request_id: self._verify(seq) for seq in plan.sequences if seq.num_draft_tokens}
        return StepResult(sampled_token_ids=sampled, verified=verified, forward_seconds=cost)

    def _verify(self, seq: ScheduledSequence) -> tuple[int, ...]:
        first = seq.start_position + len(seq.token_ids) - seq.num_draft_tokens  # the first proposal's position
        return verify_greedily(seq, lambda offset: self.token_for(seq.request_id, first + offset))

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


# ---- the scripted executor -----------------------------------------------------------------------

SCRIPT = "The quick brown fox jumps over the lazy dog. Déjà vu, naïve café; 你好，世界！🙂🚀\n".encode()
INSTANT_KV_BYTES = 64 * 1024 * 1024


class InstantExecutor:
    """No cost at all, to measure everything around the model: scheduler, engine loop, HTTP and SSE.

    Each sequence that needs a sample gets the next byte of the script, so with a byte-level tokenizer
    the output is readable text with 2-, 3- and 4-byte characters split across tokens.
    """

    def __init__(self, geometry: CacheGeometry, script: bytes = SCRIPT, end_token: int | None = None) -> None:
        self._geometry = geometry
        self._script = script
        self._end_token = end_token  # sampled once the script is out, if set; else the script repeats
        self._num_sampled: dict[str, int] = {}  # per request: where it is in the script

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def check_structured(self, structured: StructuredOutput) -> None:
        """A fake samples no grammar: it accepts every one."""

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self._num_sampled.pop(request_id, None)
        result = StepResult()
        for seq in plan.sequences:
            if seq.needs_sample and seq.num_draft_tokens:
                result.verified[seq.request_id] = self._verify(seq)
            elif seq.needs_sample:
                result.sampled_token_ids[seq.request_id] = self._next(seq.request_id)
        return result

    def _next(self, request_id: str) -> int:
        index = self._num_sampled.get(request_id, 0)
        self._num_sampled[request_id] = index + 1
        if self._end_token is not None and index >= len(self._script):
            return self._end_token
        return self._script[index % len(self._script)]

    def _verify(self, seq: ScheduledSequence) -> tuple[int, ...]:
        return verify_greedily(seq, lambda _: self._next(seq.request_id))  # the script's next bytes, in turn


def script_text(num_tokens: int, script: bytes = SCRIPT) -> str:
    """The text of an output of num_tokens byte tokens (the tail may be an incomplete character)."""
    repeated = script * (num_tokens // len(script) + 1)
    return repeated[:num_tokens].decode("utf-8", errors="replace")


def instant_geometry(settings: Settings, max_model_len: int = 4096) -> CacheGeometry:
    """The KV geometry a runner would report for settings.kv_cache_bytes (64 MiB when unset: there is
    no real memory to size it from), at a nominal block size in bytes."""
    bytes_per_block = 1024
    kv_bytes = settings.kv_cache_bytes or INSTANT_KV_BYTES
    return CacheGeometry(num_device_blocks=kv_bytes // bytes_per_block, num_cpu_blocks=0,
                         block_size=settings.block_size, bytes_per_block=bytes_per_block,
                         max_model_len=max_model_len)


# ---- wrappers ------------------------------------------------------------------------------------


class DelegatingExecutor:
    """Hands everything to another executor; a wrapper overrides what it watches."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    @property
    def geometry(self) -> CacheGeometry:
        return self.inner.geometry

    def check_structured(self, structured: StructuredOutput) -> None:
        self.inner.check_structured(structured)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.inner.execute(plan)


class RecordingExecutor(DelegatingExecutor):
    """Delegates to another executor and keeps each plan it ran."""

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner)
        self.plans: list[StepPlan] = []

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

    def check_structured(self, structured: StructuredOutput) -> None:
        """A fake samples no grammar: it accepts every one."""

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_calls += 1
        if self.num_calls >= self.fail_at:
            raise RuntimeError("injected executor failure")
        return self.inner.execute(plan)
