"""Preemption under LoRA adapters on the real runner: a batch request on one adapter, preempted (swap or
recompute) for an interactive request on another with a single device slot, resumes on its own adapter,
loaded into the slot again, and both give what `peft` gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contract.plan import LoraRef
from gpu.lora import LoraServing
from gpu.models import load_model
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine
from scheduling.request import PriorityClass
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import collect, make_request, running, tokens_of, wait_until
from tests.gpu.reference import byte_prompt, hf_greedy
from tests.gpu.test_lora import save_adapter


def lora_engine(mode: str) -> Engine:
    loaded = load_model("builtin:tiny", device="cpu", dtype="float32")  # its own: the runner wraps its layers
    bytes_per_block = kv_shape_of(loaded, 16).bytes_per_block
    budget = RunnerBudget(block_size=16, kv_cache_bytes=64 * bytes_per_block, swap_space_bytes=64 * bytes_per_block)
    runner = ModelRunner(loaded, budget, lora=LoraServing(max_loras=1, max_rank=8, max_cpu_loras=2))
    config = SchedulerConfig(max_num_seqs=1, max_loras=1, preemption_mode=mode)
    return Engine(Scheduler(config, runner.geometry), runner)


def reference(peft_model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    peft_model.generation_config.eos_token_id = None
    return hf_greedy(peft_model, prompt, max_tokens)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_a_preempted_request_resumes_on_its_own_adapter(mode: str, tmp_path: Path) -> None:
    peft_a, peft_b = save_adapter(tmp_path / "a", seed=1, rank=4), save_adapter(tmp_path / "b", seed=2, rank=8)
    engine = lora_engine(mode)
    batch = make_request(byte_prompt(20), 40, priority=PriorityClass.BATCH, tenant_id="b")
    batch.adapter = LoraRef("a", str(tmp_path / "a"), 1)
    interactive = make_request(byte_prompt(12, offset=30), 6, tenant_id="i")
    interactive.adapter = LoraRef("b", str(tmp_path / "b"), 1)
    async with running(engine):
        batch_stream = engine.submit(batch)
        await wait_until(lambda: batch.num_output_tokens >= 2, what="the batch request to decode")
        interactive_events = await collect(engine.submit(interactive))
        batch_events = await collect(batch_stream)
    assert batch.num_preemptions >= 1  # max_num_seqs=1: it gave way, and the only slot went to adapter b
    assert tokens_of(interactive_events) == reference(peft_b, interactive.prompt_token_ids, 6)
    assert tokens_of(batch_events) == reference(peft_a, batch.prompt_token_ids, 40)
