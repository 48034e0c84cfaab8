"""Prefix caching through the engine on builtin:tiny: same tokens, exact cached counts, isolation."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest

from gpu.models import LoadedModel, load_model
from gpu.runner import ModelRunner, RunnerBudget
from scheduling import prefix_cache
from scheduling.engine import Engine
from scheduling.request import Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import collect, make_fake_engine, make_request, prompt_tokens, running, wait_until

BLOCK = 16


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny")


EngineFactory = Callable[..., Engine]


@pytest.fixture
async def make_engine(tiny: LoadedModel) -> AsyncIterator[EngineFactory]:
    engines: list[Engine] = []

    def build(caching: bool = True, kv_bytes: int = 8 << 20, token_budget: int = 256) -> Engine:
        runner = ModelRunner(tiny, RunnerBudget(BLOCK, kv_bytes, 0))
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=token_budget, enable_prefix_caching=caching)
        engine = Engine(Scheduler(config, runner.geometry), runner)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        await engine.shutdown()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


async def run(engine: Engine, request_id: str, prompt: list[int], salt: str = "", max_tokens: int = 12
              ) -> tuple[list[int], TokenEvent]:
    await engine.start()
    request = Request(RequestId(request_id), prompt, max_tokens, cache_salt=salt)
    out: list[int] = []
    last: TokenEvent | None = None
    async for event in engine.submit(request):
        out.extend(event.new_token_ids)
        last = event
    assert last is not None and last.finish_reason == "length"
    return out, last


async def test_outputs_identical_with_caching_on_and_off(make_engine: EngineFactory) -> None:
    rng = random.Random(1)
    system = tokens(rng, 70)
    prompts = [system + tokens(rng, n) for n in (3, 17, 40, 1, 29)]
    results = {}
    for caching in (False, True):
        engine = make_engine(caching=caching)
        outs = [await run(engine, f"r{i}", p) for i, p in enumerate(prompts)]
        results[caching] = [o for o, _ in outs]
        cached = [e.num_cached_tokens for _, e in outs]
        assert cached == ([0] * 5 if not caching else [0, 64, 64, 64, 64])
        assert engine.stats()["kv_blocks_in_use"] == 0
    assert results[True] == results[False]


async def test_cached_tokens_respect_salts(make_engine: EngineFactory) -> None:
    rng = random.Random(2)
    shared = tokens(rng, 50)  # 3 full blocks once computed
    engine = make_engine()
    await run(engine, "first", shared + tokens(rng, 5), salt="tenant:a")
    _, same_salt = await run(engine, "same", shared + tokens(rng, 5), salt="tenant:a")
    _, other_salt = await run(engine, "other", shared + tokens(rng, 5), salt="tenant:b")
    _, group = await run(engine, "group1", shared + tokens(rng, 5), salt="group:g")
    _, group_again = await run(engine, "group2", shared + tokens(rng, 5), salt="group:g")
    assert same_salt.num_cached_tokens == 48
    assert other_salt.num_cached_tokens == 0
    assert group.num_cached_tokens == 0 and group_again.num_cached_tokens == 48


async def test_later_request_reuses_blocks_the_first_already_filled(make_engine: EngineFactory) -> None:
    """Guarantee: a request admitted after a step in which another request completed some full
    blocks of the same prefix shares those blocks instead of computing them again."""
    rng = random.Random(3)
    prompt = tokens(rng, 120)
    engine = make_engine(token_budget=32)  # the first prompt takes four steps to prefill
    first = asyncio.create_task(run(engine, "first", [*prompt, 1]))
    await wait_until(lambda: engine.scheduler.blocks.device.num_cached >= 4, what="the first prompt's blocks")
    _, second = await run(engine, "second", [*prompt, 2])
    await first
    assert second.num_cached_tokens >= 64


async def test_eviction_under_pressure_keeps_outputs_and_blocks(make_engine: EngineFactory, tiny: LoadedModel
                                                              ) -> None:
    rng = random.Random(4)
    prompts = [tokens(rng, 60) for _ in range(12)] * 2  # the second round hits or misses after eviction
    small = make_engine(kv_bytes=40 * ModelRunner(tiny, RunnerBudget(BLOCK, 1 << 20, 0)).geometry.bytes_per_block)
    roomy = make_engine(caching=False)
    got = [(await run(small, f"s{i}", p))[0] for i, p in enumerate(prompts)]
    want = [(await run(roomy, f"r{i}", p))[0] for i, p in enumerate(prompts)]
    assert got == want
    stats = small.stats()
    assert stats["kv_blocks_in_use"] == 0
    assert small.scheduler.blocks.device.num_free == stats["kv_blocks_total"]
    assert stats["prefix_cache"]["cached_blocks"] <= stats["kv_blocks_total"]


async def test_prompts_are_hashed_at_submission_and_never_again_by_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.submit makes the prompt's chain, on the caller's side of the queue; the block manager starts
    from it, so admission hashes nothing, and a second request finds the first one's blocks by it."""
    hashed: list[bytes] = []
    real_hash_block = prefix_cache.hash_block

    def counting_hash_block(parent: bytes, tokens: list[int], salt: str) -> bytes:
        hashed.append(parent)
        return real_hash_block(parent, tokens, salt)

    monkeypatch.setattr(prefix_cache, "hash_block", counting_hash_block)
    engine = make_fake_engine(block_size=4)
    prompt = prompt_tokens(18)  # 4 full blocks and 2 tokens; with one output token no fifth block fills
    async with running(engine):
        first = make_request(prompt, 1)
        stream = engine.submit(first)
        assert len(first.prompt_block_hashes) == len(hashed) == 4
        await collect(stream)
        second = make_request(prompt, 1)
        events = await collect(engine.submit(second))
    assert len(hashed) == 8  # the second prompt's four blocks at its submission; no step hashed any
    assert events[-1].num_cached_tokens == 16
