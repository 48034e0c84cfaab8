"""The KV cache's dtype: a 16-bit pool holds twice the tokens in the same bytes, attention reads it in
place (the logits stay within a stated tolerance of a float32 pool's), and requests served over it,
swapped out and back, all finish and free every block."""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract.plan import SamplingParams, ScheduledSequence
from gpu.kv_cache import resolve_kv_cache_dtype
from gpu.models import LoadedModel
from scheduling.scheduler import SchedulerConfig
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, make_runner, running, tokens_of
from tests.gpu.reference import byte_prompt

CPU = torch.device("cpu")
SIXTEEN_BITS = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", SIXTEEN_BITS)
def test_a_16_bit_pool_holds_twice_the_blocks_in_the_same_bytes(tiny_model: LoadedModel, kv_dtype: torch.dtype
                                                                 ) -> None:
    wide = make_runner(tiny_model, num_blocks=20)
    narrow = make_runner(tiny_model, num_blocks=40, kv_dtype=kv_dtype)
    assert narrow.geometry.bytes_per_block * 2 == wide.geometry.bytes_per_block
    assert narrow.cache.device_pool.dtype == kv_dtype and narrow.cache.cpu_pool.dtype == kv_dtype
    assert narrow.cache.device_pool.nbytes == wide.cache.device_pool.nbytes


def decode_logits(loaded: LoadedModel, kv_dtype: torch.dtype | None, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt read in two chunks (the second over the cached first), then one decode step of all."""
    runner = make_runner(loaded, num_blocks=64, block_size=8, kv_dtype=kv_dtype)
    tables = [tuple(range(16 * i, 16 * (i + 1))) for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        half = len(prompt) // 2
        for start, chunk in ((0, prompt[:half]), (half, prompt[half:])):
            runner.compute_logits([ScheduledSequence(f"s{i}", chunk, start, tables[i], True, SamplingParams())])
    decodes = [ScheduledSequence(f"s{i}", [65], len(p), tables[i], True, SamplingParams())
               for i, p in enumerate(prompts)]
    return runner.compute_logits(decodes)


@pytest.mark.parametrize("kv_dtype", SIXTEEN_BITS)
def test_attention_over_a_16_bit_pool_tracks_a_float32_one(tiny_model: LoadedModel, kv_dtype: torch.dtype) -> None:
    prompts = [byte_prompt(40 + 17 * i, offset=5 * i) for i in range(3)]
    wide = decode_logits(tiny_model, None, prompts)
    narrow = decode_logits(tiny_model, kv_dtype, prompts)
    # Keys and values rounded to 8 (bfloat16) or 11 (float16) significant bits: a few hundredths of a
    # logit at most over this model's logits of magnitude ~10, and the same greedy pick.
    assert (narrow - wide).abs().max() < 0.1, float((narrow - wide).abs().max())
    assert torch.equal(narrow.argmax(-1), wide.argmax(-1))
    assert (narrow - wide).abs().max() > 0  # the pool really is narrower


async def test_requests_over_a_bfloat16_pool_swap_out_and_back_and_free_every_block(tiny_model: LoadedModel
                                                                                     ) -> None:
    engine = make_engine(tiny_model, num_blocks=24, block_size=8, num_cpu_blocks=64, kv_dtype=torch.bfloat16,
                         config=SchedulerConfig(preemption_mode="swap"))
    prompts = [byte_prompt(30 + 9 * i, offset=7 * i) for i in range(5)]
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, 24))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert engine.stats()["preemptions"]["swap"] > 0
        assert_kv_all_free(engine)
    assert all(len(tokens_of(events)) == 24 for events in results)


def test_a_named_kv_dtype_is_kept_and_auto_halves_a_float32_pool_on_the_cpu() -> None:
    assert resolve_kv_cache_dtype("float16", torch.float32, CPU) == torch.float16
    assert resolve_kv_cache_dtype("float32", torch.float32, CPU) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float16, torch.device("cuda")) == torch.float16
