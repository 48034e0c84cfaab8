"""The architectures of tests/gpu/architectures.py through the compiled step (inductor, the whole model
in one graph): the same greedy tokens and logprobs as transformers' eager `generate`, over chunked
prefill, decodes beside prompt chunks and swapped-out sequences, with no compilation after warm-up. The
MoE families go through transformers' own expert code inside the graph. (Which families run by default:
IN_THE_SUITE.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.fake_executors import RecordingExecutor
from gpu.compiled import CompileConfig
from gpu.models import load_model
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.gpu.architectures import CONFIGS, WINDOW, prompts, reference, write_checkpoint
from tests.gpu.test_architectures import NEW_TOKENS, PROMPT_LENGTH, assert_matches, served

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS, NUM_CPU_BLOCKS = 4, 14, 32
# Each family compiles for 10-35 s on two cores, all fifteen for 4.5 minutes: more than the suite can give.
# The suite compiles the families whose graphs differ in what the paged attention and the model code
# trace (Llama's is tests/gpu/test_compiled.py's; mistral's window, every layer windowed, is phi3_window's);
# FAIRLANE_ALL_ARCHITECTURES=1 compiles every one.
IN_THE_SUITE = ("gemma2", "gemma3_text", "gpt_oss", "phi3_window", "qwen3_moe")
FAMILIES = sorted(CONFIGS) if os.environ.get("FAIRLANE_ALL_ARCHITECTURES") == "1" else IN_THE_SUITE


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every family: the kernels two tiny models share (norms, rotary, the attention's
    reductions) are built once."""
    return tmp_path_factory.mktemp("inductor")


@pytest.mark.parametrize("family", FAMILIES)
async def test_compiled_step_matches_transformers(family: str, tmp_path: Path, inductor_cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    model = write_checkpoint(family, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    bytes_per_block = kv_shape_of(loaded, BLOCK_SIZE, torch.float32).bytes_per_block
    budget = RunnerBudget(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * bytes_per_block,
                          swap_space_bytes=NUM_CPU_BLOCKS * bytes_per_block, kv_cache_dtype=torch.float32)
    torch._dynamo.reset()  # the family's own graph, not code an earlier family left in this process
    runner = ModelRunner(loaded, budget, CompileConfig("default"))
    assert runner.forward.is_compiled
    distinct = prompts(3, PROMPT_LENGTH)
    references = [reference(model, prompt, NEW_TOKENS) for prompt in distinct]
    config = SchedulerConfig(max_num_batched_tokens=2 * WINDOW)  # chunks beside decodes, and a swap
    engine = Engine(Scheduler(config, runner.geometry), RecordingExecutor(runner))
    assert_matches(await served(engine, distinct), references)
    assert engine.stats()["preemptions"]["swap"] > 0
    assert runner.forward.recompilations == 0
