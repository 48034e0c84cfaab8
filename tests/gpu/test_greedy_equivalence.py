"""Greedy output of the engine (paged KV, packed batches, chunked prefill, preemption) is token for
token what Hugging Face generate gives for each prompt alone."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import pytest

from gpu.models import LoadedModel
from scheduling.engine import Engine, RequestStream
from scheduling.request import Request, RequestId, TokenEvent
from scheduling.scheduler import SchedulerConfig
from tests.factories import (
    assert_kv_all_free,
    collect,
    has_mixed_step,
    has_split_prefill,
    make_engine,
    make_request,
    plans_of,
    running,
    tokens_of,
)
from tests.gpu.reference import GreedyCase, byte_prompt, hf_greedy


def requests_for(cases: Sequence[GreedyCase]) -> list[Request]:
    return [make_request(case.prompt, case.max_tokens) for case in cases]


async def submit_all(engine: Engine, requests: Sequence[Request]) -> list[list[TokenEvent]]:
    streams = [engine.submit(request) for request in requests]
    return list(await asyncio.gather(*(collect(stream) for stream in streams)))


async def submit_staggered(engine: Engine, requests: Sequence[Request], every: int
                           ) -> list[list[TokenEvent]]:
    """Submit the first request; then one more after every `every` events of a request that is still
    running, so each newcomer's prefill shares steps with others' decodes."""
    backlog = deque(requests)
    results: dict[RequestId, list[TokenEvent]] = {r.request_id: [] for r in requests}
    tasks: list[asyncio.Task[None]] = []
    num_events = 0

    def submit_next() -> None:
        request = backlog.popleft()
        tasks.append(asyncio.create_task(consume(request.request_id, engine.submit(request))))

    async def consume(request_id: RequestId, stream: RequestStream) -> None:
        nonlocal num_events
        async for event in stream:
            results[request_id].append(event)
            num_events += 1
            if backlog and num_events % every == 0 and not event.is_final:
                submit_next()
        others_running = [t for t in tasks if t is not asyncio.current_task() and not t.done()]
        if backlog and not others_running:  # nobody is left to trigger the next one
            submit_next()

    submit_next()
    async with asyncio.timeout(120):
        while pending := [t for t in tasks if not t.done()]:
            await asyncio.gather(*pending)
    return [results[r.request_id] for r in requests]


def assert_matches_reference(cases: Sequence[GreedyCase], results: Sequence[Sequence[TokenEvent]]) -> None:
    for case, events in zip(cases, results, strict=True):
        label = f"prompt of {len(case.prompt)} tokens, max_tokens {case.max_tokens}"
        assert tokens_of(events) == case.expected, label
        assert events[-1].finish_reason == "length", label
        assert events[-1].num_output_tokens == case.max_tokens, label
        assert events[-1].num_prompt_tokens == len(case.prompt), label
        assert all(len(event.new_token_ids) == 1 for event in events), label


def test_cases_cover_short_and_long_prompts(tiny_greedy_cases: list[GreedyCase]) -> None:
    lengths = [len(case.prompt) for case in tiny_greedy_cases]
    assert len(tiny_greedy_cases) >= 12
    assert min(lengths) == 1 and max(lengths) >= 200
    assert len({case.max_tokens for case in tiny_greedy_cases}) >= 10


async def test_all_at_once_matches_hf(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase]) -> None:
    engine = make_engine(tiny_model, num_blocks=256, block_size=8,
                         config=SchedulerConfig(max_num_batched_tokens=4096))
    async with running(engine):
        requests = requests_for(tiny_greedy_cases)
        results = await submit_all(engine, requests)
        assert await engine.wait_idle(timeout=10)
        assert_matches_reference(tiny_greedy_cases, results)
        assert len(plans_of(engine)[0].sequences) == len(requests)  # one packed step prefilled them all
        assert engine.stats()["requests_finished"] == len(requests)
        assert_kv_all_free(engine)


async def test_staggered_arrivals_match_hf(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase]) -> None:
    engine = make_engine(tiny_model, num_blocks=256, block_size=8)
    async with running(engine):
        results = await submit_staggered(engine, requests_for(tiny_greedy_cases), every=3)
        assert await engine.wait_idle(timeout=10)
        assert_matches_reference(tiny_greedy_cases, results)
        assert has_mixed_step(plans_of(engine))
        assert_kv_all_free(engine)


@pytest.mark.parametrize("max_num_batched_tokens", [7, 64])
async def test_token_budget_chunks_match_hf(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase],
                                            max_num_batched_tokens: int) -> None:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens)
    engine = make_engine(tiny_model, num_blocks=256, block_size=8, config=config)
    async with running(engine):
        results = await submit_all(engine, requests_for(tiny_greedy_cases))
        assert await engine.wait_idle(timeout=10)
        assert_matches_reference(tiny_greedy_cases, results)
        plans = plans_of(engine)
        assert all(plan.num_tokens <= max_num_batched_tokens for plan in plans)
        assert has_split_prefill(plans)
        assert has_mixed_step(plans)
        assert_kv_all_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_preemption_matches_hf(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase],
                                     mode: str) -> None:
    # 40 blocks of 8 tokens: every request fits alone, but not all of them together.
    config = SchedulerConfig(preemption_mode=mode)
    engine = make_engine(tiny_model, num_blocks=40, block_size=8, num_cpu_blocks=64, config=config)
    async with running(engine):
        requests = requests_for(tiny_greedy_cases)
        results = await submit_all(engine, requests)
        assert await engine.wait_idle(timeout=10)
        assert_matches_reference(tiny_greedy_cases, results)
        assert engine.stats()["preemptions"][mode] > 0
        assert any(request.num_preemptions > 0 and request.num_output_tokens > 1 for request in requests)
        assert_kv_all_free(engine)


async def test_prefix_cache_hits_match_hf(tiny_model: LoadedModel, tiny_reference: Any) -> None:
    shared = byte_prompt(70, offset=3)
    prompts = [shared + list(f" question {i}: what comes next?".encode()[: 2 + 5 * i]) for i in range(5)]
    cases = [GreedyCase(p, 10, hf_greedy(tiny_reference, p, 10)) for p in prompts]
    engine = make_engine(tiny_model, num_blocks=128, block_size=8, config=SchedulerConfig(max_num_batched_tokens=16))
    async with running(engine):
        first = await collect(engine.submit(make_request(cases[0].prompt, cases[0].max_tokens)))
        rest = await submit_all(engine, requests_for(cases[1:]))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert_matches_reference(cases, [first, *rest])
    assert first[-1].num_cached_tokens == 0
    assert all(events[-1].num_cached_tokens >= 64 for events in rest)  # eight full blocks of the prefix
