"""Prompt log probabilities (completions' echo with logprobs) through the engine, against a plain
transformers forward: chunked prefill, the prefix cache bypassed, and a recomputed prompt."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contract.plan import SamplingParams
from gpu.models import LoadedModel
from scheduling.scheduler import SchedulerConfig
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, running
from tests.gpu.reference import byte_prompt, hf_logits

PROMPT = byte_prompt(40, offset=3)
TOP_K = 3


@pytest.mark.parametrize("chunk_tokens", [16, 512])
async def test_prompt_logprobs_match_transformers(tiny_model: LoadedModel, tiny_reference: Any,
                                                  chunk_tokens: int) -> None:
    expected = torch.log_softmax(hf_logits(tiny_reference, PROMPT), dim=-1)
    engine = make_engine(tiny_model, num_blocks=64, block_size=8,
                         config=SchedulerConfig(max_num_batched_tokens=chunk_tokens))
    sampling = SamplingParams(prompt_logprobs=TOP_K)
    async with running(engine):
        warm = await collect(engine.submit(make_request(PROMPT, 2)))  # puts the prompt's blocks in the cache
        events = await collect(engine.submit(make_request(PROMPT, 2, sampling=sampling)))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)

    entries = events[0].prompt_logprobs
    assert warm[0].prompt_logprobs == () and all(e.prompt_logprobs == () for e in events[1:])
    assert events[0].num_cached_tokens == 0  # computed whole, never taken from the cache
    assert [e.token_id for e in entries] == PROMPT[1:]
    for position, entry in enumerate(entries, start=1):
        assert entry.logprob == pytest.approx(float(expected[position - 1, PROMPT[position]]), abs=1e-4)
        top = torch.topk(expected[position - 1], TOP_K)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
