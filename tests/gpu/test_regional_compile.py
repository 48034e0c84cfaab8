"""Regional compilation (`--compile-scope layer`, gpu/compiled.py): one decoder layer's graph shared by
every layer. On builtin:tiny: logits within the compiled forward's tolerance of eager float32, two
graphs in all (the first layer's, then the one every layer shares) whatever the step's shape, greedy
tokens equal to Hugging Face's through the engine."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.fake_executors import RecordingExecutor
from gpu.compiled import CompileConfig
from gpu.models import LoadedModel
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from gpu.step_inputs import decodes_first
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import assert_kv_all_free, make_runner, running
from tests.gpu.reference import GreedyCase
from tests.gpu.test_compiled import LOGIT_TOLERANCE, prompt_then_decodes, sequence
from tests.gpu.test_greedy_equivalence import assert_matches_reference, requests_for, submit_all

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS = 8, 256


@pytest.fixture(scope="module")
def regional_runner(tiny_model: LoadedModel, compile_artifacts: Path) -> Iterator[ModelRunner]:
    bytes_per_block = kv_shape_of(tiny_model, BLOCK_SIZE).bytes_per_block
    budget = RunnerBudget(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * bytes_per_block, swap_space_bytes=0)
    yield ModelRunner(tiny_model, budget, CompileConfig("default", str(compile_artifacts), "layer"))


def test_logits_match_eager_and_every_step_shape_shares_the_two_graphs(tiny_model: LoadedModel,
                                                                       regional_runner: ModelRunner) -> None:
    forward = regional_runner.forward
    assert forward.is_compiled and forward.scope == "layer"
    eager = make_runner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    for step in prompt_then_decodes(seed=3):
        expected, got = eager.compute_logits(step), regional_runner.compute_logits(step)
        torch.testing.assert_close(got, expected, atol=LOGIT_TOLERANCE, rtol=0)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    rng = random.Random(11)
    for _ in range(20):
        sequences = [sequence(f"d{i}", rng.randrange(1, 60), [3], 30 * i) for i in range(rng.randrange(0, 6))]
        sequences += [sequence(f"p{i}", rng.choice([0, 8, 13]), [4] * rng.randrange(2, 40), 150 + 12 * i)
                      for i in range(rng.randrange(0, 3))]
        if sequences:
            regional_runner.compute_logits(decodes_first(sequences))
    assert forward.num_graphs == 2  # the first layer's, with its index a constant; then the shared one
    assert forward.recompilations == 0


async def test_greedy_tokens_match_hf_through_the_engine(regional_runner: ModelRunner,
                                                         tiny_greedy_cases: list[GreedyCase]) -> None:
    executor = RecordingExecutor(regional_runner)
    engine = Engine(Scheduler(SchedulerConfig(max_num_batched_tokens=64), executor.geometry), executor)
    async with running(engine):
        results = await submit_all(engine, requests_for(tiny_greedy_cases))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert_matches_reference(tiny_greedy_cases, results)
    assert engine.stats()["forward_recompilations"] == 0
