"""The compiled forward (gpu/compiled.py) on builtin:tiny: logits within a stated tolerance of eager
float32, greedy tokens equal to Hugging Face generate through the engine (packed prompts, staggered
arrivals, chunked prefill, preemption by swap and by recompute), no compilation after start-up
whatever the step's shape, and artifacts a second process loads from disk instead of compiling.

One compiled runner serves the whole module: compiling costs far more than a test."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.fake_executors import RecordingExecutor
from contract.plan import SamplingParams, ScheduledSequence
from gpu.compiled import CompileConfig, CompileMode
from gpu.models import LoadedModel
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from gpu.step_inputs import decodes_first
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import assert_kv_all_free, make_runner, plans_of, running
from tests.gpu.reference import GreedyCase
from tests.gpu.test_greedy_equivalence import assert_matches_reference, requests_for, submit_all, submit_staggered

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS, NUM_CPU_BLOCKS = 8, 256, 64
MODE: CompileMode = "max"
# float32 logits of the compiled graph against eager: inductor fuses and reorders reductions, so the
# last bits differ; a hundredth of a logit is far below any gap greedy decoding relies on here.
LOGIT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def artifact_root(compile_artifacts: Path) -> Path:
    return compile_artifacts


@pytest.fixture(scope="module")
def compiled_runner(tiny_model: LoadedModel, artifact_root: Path) -> Iterator[ModelRunner]:
    bytes_per_block = kv_shape_of(tiny_model, BLOCK_SIZE).bytes_per_block
    budget = RunnerBudget(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * bytes_per_block,
                          swap_space_bytes=NUM_CPU_BLOCKS * bytes_per_block)
    # An earlier test of this process may have compiled this model in this mode: dynamo would hand this
    # runner that code (no graph of its own to count) and inductor's disk cache would hold only that
    # runner's graphs. From dynamo's initial state, this runner compiles its own. (tests/isolation.py
    # isolates one test; this runner is shared by the module's tests, so it is reset here instead.)
    torch._dynamo.reset()
    yield ModelRunner(tiny_model, budget, CompileConfig(MODE, str(artifact_root)))


def engine_over(runner: ModelRunner, config: SchedulerConfig | None = None, num_blocks: int = NUM_BLOCKS) -> Engine:
    """An engine over the shared runner whose scheduler may use only num_blocks of its pool."""
    executor = RecordingExecutor(runner)
    geometry = replace(runner.geometry, num_device_blocks=num_blocks)
    return Engine(Scheduler(config or SchedulerConfig(), geometry), executor)


def sequence(name: str, start: int, tokens: list[int], first_block: int) -> ScheduledSequence:
    num_blocks = -(-(start + len(tokens)) // BLOCK_SIZE)
    return ScheduledSequence(name, tokens, start, tuple(range(first_block, first_block + num_blocks)), True,
                             SamplingParams())


def prompt_then_decodes(seed: int) -> list[list[ScheduledSequence]]:
    """Steps over three requests: prompts packed together, a second chunk beside decodes, then decodes."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 19, 12)]
    return [
        decodes_first([sequence("a", 0, prompts[0], 0), sequence("b", 0, prompts[1][:9], 10)]),
        decodes_first([sequence("a", 5, [7], 0), sequence("b", 9, prompts[1][9:], 10),
                       sequence("c", 0, prompts[2], 20)]),
        decodes_first([sequence("a", 6, [8], 0), sequence("b", 19, [9], 10), sequence("c", 12, [10], 20)]),
        [sequence("c", 13, [11], 20)],
    ]


def test_logits_match_eager_float32(tiny_model: LoadedModel, compiled_runner: ModelRunner) -> None:
    eager = make_runner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert compiled_runner.forward.is_compiled and not eager.forward.is_compiled
    for step in prompt_then_decodes(seed=1):
        expected, got = eager.compute_logits(step), compiled_runner.compute_logits(step)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=LOGIT_TOLERANCE, rtol=0)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_no_compilation_after_start_up_whatever_the_step(compiled_runner: ModelRunner) -> None:
    rng = random.Random(7)
    for _ in range(25):
        num_decodes, num_chunks = rng.randrange(0, 6), rng.randrange(0, 3)
        sequences = [sequence(f"d{i}", rng.randrange(1, 60), [3], 30 * i) for i in range(num_decodes)]
        sequences += [sequence(f"p{i}", rng.choice([0, 8, 13]), [4] * rng.randrange(2, 40), 150 + 12 * i)
                      for i in range(num_chunks)]
        if sequences:
            compiled_runner.compute_logits(decodes_first(sequences))
    assert compiled_runner.forward.compile_seconds > 0
    assert compiled_runner.forward.num_graphs == 1  # one graph for every step
    assert compiled_runner.forward.recompilations == 0


async def test_packed_and_staggered_requests_match_hf(compiled_runner: ModelRunner,
                                                      tiny_greedy_cases: list[GreedyCase]) -> None:
    engine = engine_over(compiled_runner, SchedulerConfig(max_num_batched_tokens=4096))
    async with running(engine):
        assert_matches_reference(tiny_greedy_cases, await submit_all(engine, requests_for(tiny_greedy_cases)))
        assert_matches_reference(tiny_greedy_cases,
                                 await submit_staggered(engine, requests_for(tiny_greedy_cases), every=3))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert engine.stats()["forward_recompilations"] == 0


async def test_chunked_prefill_matches_hf(compiled_runner: ModelRunner, tiny_greedy_cases: list[GreedyCase]) -> None:
    engine = engine_over(compiled_runner, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=7))
    async with running(engine):
        results = await submit_all(engine, requests_for(tiny_greedy_cases))
        assert await engine.wait_idle(timeout=10)
    assert_matches_reference(tiny_greedy_cases, results)
    assert all(plan.num_tokens <= 7 for plan in plans_of(engine))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_preemption_matches_hf(compiled_runner: ModelRunner, tiny_greedy_cases: list[GreedyCase],
                                     mode: str) -> None:
    # 40 blocks of 8 tokens: every request fits alone, but not all of them together.
    engine = engine_over(compiled_runner, SchedulerConfig(preemption_mode=mode), num_blocks=40)
    async with running(engine):
        requests = requests_for(tiny_greedy_cases)
        results = await submit_all(engine, requests)
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert_matches_reference(tiny_greedy_cases, results)
    assert engine.stats()["preemptions"][mode] > 0
    assert engine.stats()["forward_recompilations"] == 0


SECOND_START = """
import json, sys, torch
from gpu.compiled import CompileConfig
from gpu.models import load_model
from gpu.runner import ModelRunner, RunnerBudget
torch.set_num_threads(int(sys.argv[3]))  # the kernels are generated for a number of threads
runner = ModelRunner(load_model("builtin:tiny", device="cpu", dtype="float32"),  # a pool of another size
                     RunnerBudget(block_size=8, kv_cache_bytes=1 << 20, swap_space_bytes=0),
                     CompileConfig(sys.argv[1], sys.argv[2]))
print(json.dumps(dict(torch._dynamo.utils.counters["inductor"])))
"""


def test_a_second_start_loads_the_artifacts(compiled_runner: ModelRunner, artifact_root: Path) -> None:
    """A new process with the same model, dtype and mode compiles no graph again, even with a KV pool
    of another size: every graph is a hit of inductor's on-disk cache, under the folder the first
    start filled."""
    folders = [path for path in artifact_root.iterdir() if path.name.startswith("llama-model-")]
    assert folders, "the compiled runner wrote no artifact folder"
    finished = subprocess.run([sys.executable, "-c", SECOND_START, MODE, str(artifact_root),
                               str(torch.get_num_threads())], capture_output=True,
                              text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert finished.returncode == 0, finished.stderr[-2000:]
    counters = json.loads(finished.stdout.strip().splitlines()[-1])
    assert counters.get("fxgraph_cache_hit", 0) >= 1, counters
    assert counters.get("fxgraph_cache_miss", 0) == 0, counters
