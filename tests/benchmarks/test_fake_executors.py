"""The executors without a model keep their promises: deterministic tokens and a virtual clock, no real time."""

from __future__ import annotations

from benchmarks.fake_executors import (
    SCRIPT,
    FakeExecutor,
    InstantExecutor,
    LinearStepCost,
    TokenCosts,
    fake_token,
    script_text,
)
from contract.plan import SamplingParams, ScheduledSequence, StepPlan
from scheduling.executor import Executor
from tests.factories import make_geometry


def sequence(request_id: str, start: int, num_tokens: int, needs_sample: bool = True) -> ScheduledSequence:
    return ScheduledSequence(request_id, list(range(num_tokens)), start, (0,), needs_sample, SamplingParams())


def test_tokens_depend_only_on_request_and_position() -> None:
    executor: Executor = FakeExecutor(make_geometry())
    alone = executor.execute(StepPlan([sequence("a", 0, 5)]))
    crowded = executor.execute(StepPlan([sequence("b", 3, 1), sequence("a", 0, 5), sequence("c", 0, 7, False)]))
    assert alone.sampled_token_ids == {"a": fake_token("a", 5, 320)}
    assert crowded.sampled_token_ids == {"a": fake_token("a", 5, 320), "b": fake_token("b", 4, 320)}


def test_clock_charges_prefill_and_decode_tokens() -> None:
    executor = FakeExecutor(make_geometry(), TokenCosts(prefill_token=0.01, decode_token=0.5, step=2.0))
    result = executor.execute(StepPlan([sequence("a", 9, 1), sequence("b", 0, 6, False), sequence("c", 0, 4)]))
    expected = 2.0 + 10 * 0.01 + 1 * 0.5
    assert abs(executor.clock - expected) < 1e-9 and abs(result.forward_seconds - expected) < 1e-9
    executor.execute(StepPlan(finished_request_ids=["a"]))  # nothing to compute: no time passes
    assert abs(executor.clock - expected) < 1e-9
    assert (executor.tally.num_steps, executor.tally.num_prefill_tokens, executor.tally.num_decode_tokens) == (1, 10, 1)
    assert executor.tally.tokens_by_request == {"a": 1, "b": 6, "c": 4}
    assert len(executor.plans) == 2


def test_linear_step_cost_prices_every_token_alike() -> None:
    executor = FakeExecutor(make_geometry(), LinearStepCost(overhead_s=0.5, per_token_s=0.01), vocab_size=256)
    result = executor.execute(StepPlan([sequence("a", 9, 1), sequence("b", 0, 6, False), sequence("c", 0, 4)]))
    assert result.forward_seconds == executor.clock == 0.5 + 0.01 * 11
    assert executor.execute(StepPlan(finished_request_ids=["a"])).forward_seconds == 0.0
    assert set(result.sampled_token_ids.values()) <= set(range(256))


def test_instant_executor_samples_the_script_then_the_end_token() -> None:
    executor = InstantExecutor(make_geometry(), script=b"hi", end_token=0)
    sampled = [executor.execute(StepPlan([sequence("a", i, 1)])).sampled_token_ids["a"] for i in range(4)]
    assert sampled == [ord("h"), ord("i"), 0, 0]
    assert executor.execute(StepPlan(finished_request_ids=["a"])).sampled_token_ids == {}
    assert executor.execute(StepPlan([sequence("a", 0, 3)])).sampled_token_ids == {"a": ord("h")}  # forgotten
    assert script_text(len(SCRIPT) + 3) == (SCRIPT + SCRIPT[:3]).decode()
