"""Serving while compiling (gpu/background_compile.py): the runner answers eagerly while a child process
compiles, says how far the child has come, switches to the compiled forward between two steps, and
goes on eagerly when the child fails.

The child here is a stand-in that reports one warm-up step and waits for the test to let it exit, so
the test decides when "compiling" ends. The load that follows is real: the compiled forward is built
and warmed up over a scratch pool while the engine serves (into a folder of the test's own, since a
folder a warm-up has filled starts no child at all: the last test)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.fake_executors import RecordingExecutor
from gpu.compiled import CompileConfig
from gpu.models import LoadedModel
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import assert_kv_all_free, collect, make_request, running, wait_until
from tests.gpu.reference import GreedyCase
from tests.gpu.test_greedy_equivalence import assert_matches_reference, requests_for, submit_all

BLOCK_SIZE, NUM_BLOCKS = 8, 256

# Reports warm-up step 1 of 3, then waits (at most two minutes) for the gate file, then exits with the
# status given.
STAND_IN_CHILD = """
import json, os, sys, time
gate, status = sys.argv[1], int(sys.argv[2])
print(json.dumps({"step": 1, "num_steps": 3, "label": "one decode"}), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(status)
"""


@dataclass
class CompilingRunner:
    runner: ModelRunner
    gate: Path  # touch it to let the child exit

    def finish_compiling(self) -> None:
        self.gate.touch()


def compiling_runner(loaded: LoadedModel, artifacts: Path, gate: Path, exit_status: int) -> ModelRunner:
    bytes_per_block = kv_shape_of(loaded, BLOCK_SIZE).bytes_per_block
    budget = RunnerBudget(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * bytes_per_block, swap_space_bytes=0)
    child = (sys.executable, "-c", STAND_IN_CHILD, str(gate), str(exit_status))
    runner = ModelRunner(loaded, budget, CompileConfig("max", str(artifacts), child_command=child))
    assert runner.compile_status is not None and runner.compile_status.state == "compiling"
    runner.start_compiling()  # as the server does once it is up
    return runner


@pytest.fixture
def compiling(tiny_model: LoadedModel, tmp_path: Path) -> Iterator[CompilingRunner]:
    gate = tmp_path / "compiled"
    runner = compiling_runner(tiny_model, tmp_path / "artifacts", gate, exit_status=0)
    yield CompilingRunner(runner, gate)
    runner.close()


def engine_over(runner: ModelRunner) -> Engine:
    executor = RecordingExecutor(runner)
    return Engine(Scheduler(SchedulerConfig(), executor.geometry), executor)


def status_of(runner: ModelRunner) -> str:
    status = runner.compile_status
    assert status is not None
    return status.state


@pytest.mark.slow
async def test_serves_eagerly_while_compiling_then_switches(compiling: CompilingRunner,
                                                            tiny_greedy_cases: list[GreedyCase]) -> None:
    runner = compiling.runner
    engine = engine_over(runner)
    async with running(engine):
        await wait_until(lambda: runner.compile_status is not None and runner.compile_status.step == 1,
                         timeout=60, what="the child's first progress line")
        status = runner.compile_status
        assert status is not None and status.state == "compiling" and status.num_steps == 3
        assert status.describe() == "compiling, step 2 of 3"
        # Answers while the child compiles: eager, and the model's own tokens.
        assert_matches_reference(tiny_greedy_cases, await submit_all(engine, requests_for(tiny_greedy_cases)))
        assert not runner.forward.is_compiled and status_of(runner) == "compiling"

        compiling.finish_compiling()
        await wait_until(lambda: status_of(runner) == "ready", timeout=600, interval=0.05,
                         what="the compiled forward to load")
        # The first step after the load runs compiled; its answers are the model's all the same.
        assert_matches_reference(tiny_greedy_cases, await submit_all(engine, requests_for(tiny_greedy_cases)))
        assert runner.forward.is_compiled and runner.forward.recompilations == 0
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert engine.stats()["forward_recompilations"] == 0


async def test_a_failed_compilation_leaves_the_runner_serving_eagerly(
        tiny_model: LoadedModel, tmp_path: Path, tiny_greedy_cases: list[GreedyCase]) -> None:
    gate = tmp_path / "compiled"
    gate.touch()  # the child exits at once, with status 3
    runner = compiling_runner(tiny_model, tmp_path / "artifacts", gate, exit_status=3)
    engine = engine_over(runner)
    try:
        async with running(engine):
            await wait_until(lambda: status_of(runner) == "failed", timeout=60, what="the child's failure")
            status = runner.compile_status
            assert status is not None and status.error == "the compiling process exited with status 3"
            assert_matches_reference(tiny_greedy_cases, await submit_all(engine, requests_for(tiny_greedy_cases)))
            assert not runner.forward.is_compiled
    finally:
        runner.close()


async def test_closing_the_runner_stops_the_child(compiling: CompilingRunner) -> None:
    runner = compiling.runner
    await wait_until(lambda: runner.compile_status is not None and runner.compile_status.step == 1, timeout=60,
                     what="the child to start")
    assert runner.background is not None
    runner.close()
    await wait_until(lambda: status_of(runner) == "stopped", timeout=30, what="the stopped child to be seen")
    assert not runner.forward.is_compiled


@pytest.mark.slow
async def test_a_folder_a_warm_up_filled_loads_without_a_child(tiny_model: LoadedModel, compile_artifacts: Path,
                                                               tmp_path: Path) -> None:
    """A restart over a filled artifact folder: no child is started (this one would fail), the compiled
    forward is loaded at once while the runner serves eagerly."""
    bytes_per_block = kv_shape_of(tiny_model, BLOCK_SIZE).bytes_per_block
    budget = RunnerBudget(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * bytes_per_block, swap_space_bytes=0)
    ModelRunner(tiny_model, budget, CompileConfig("max", str(compile_artifacts)))  # compiles first, then marks
    runner = compiling_runner(tiny_model, compile_artifacts, tmp_path / "never", exit_status=3)
    try:
        await wait_until(lambda: status_of(runner) in {"ready", "failed"}, timeout=600, interval=0.05,
                         what="the load")
        assert status_of(runner) == "ready"
        assert runner.background is not None and runner.background.status.num_steps == 0  # no child spoke
        engine = engine_over(runner)
        async with running(engine):
            assert await wait_until_served(engine)
        assert runner.forward.is_compiled and runner.forward.recompilations == 0
    finally:
        runner.close()


async def wait_until_served(engine: Engine) -> bool:
    """One request served: the step that runs it switches to the compiled forward first."""
    events = await collect(engine.submit(make_request(9, max_tokens=3)), timeout=60)
    return events[-1].finish_reason == "length"
