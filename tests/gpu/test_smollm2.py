"""The default model, SmolLM2-135M-Instruct: the engine agrees with Hugging Face and answers sensibly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.models import SMOLLM2_SPEC, LoadedModel, convert_smollm2, load_model
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, running, tokens_of
from tests.gpu.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(model_cache_dir: Path) -> LoadedModel:
    return load_model(SMOLLM2_SPEC, device="cpu", dtype="float32", cache_dir=str(model_cache_dir))


@pytest.fixture(scope="module")
def smollm2_reference(model_cache_dir: Path) -> Any:
    """A second copy of the converted checkpoint with transformers' own attention; EOS not special."""
    model = AutoModelForCausalLM.from_pretrained(str(convert_smollm2(model_cache_dir)), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


async def test_greedy_matches_hf(smollm2: LoadedModel, smollm2_reference: Any) -> None:
    prompts = [smollm2.tokenizer.encode(text) for text in PROMPTS]
    expected = [hf_greedy(smollm2_reference, prompt, MAX_TOKENS) for prompt in prompts]
    engine = make_engine(smollm2, num_blocks=32, block_size=16)
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, MAX_TOKENS))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert [tokens_of(events) for events in results] == expected


async def test_chat_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = make_engine(smollm2, num_blocks=32, block_size=16)
    async with running(engine):
        request = make_request(prompt, 48, stop_token_ids=tokenizer.eos_token_ids)
        events = await collect(engine.submit(request))
    answer = tokenizer.decode(tokens_of(events))
    assert "Paris" in answer, answer
    assert events[-1].finish_reason == "stop"  # the end-of-turn token ends it, well before max_tokens
