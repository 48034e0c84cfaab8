"""The prefix cache's host and disk tiers through the engine on builtin:tiny (float32): blocks written
down and copied up give the tokens of blocks never evicted, a restart serves a prefix from disk, and a
disk tier of another layout is left alone."""

from __future__ import annotations

import os
import random
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpu.kv_cache import KVShape
from gpu.models import LoadedModel, load_model
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine
from scheduling.request import Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig

BLOCK = 16


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny")


EngineFactory = Callable[..., Engine]


@pytest.fixture
async def make_engine(tiny: LoadedModel) -> AsyncIterator[EngineFactory]:
    engines: list[Engine] = []

    def build(device_blocks: int = 16, host_blocks: int = 0, disk: Path | None = None, block_size: int = BLOCK
              ) -> Engine:
        shape: KVShape = kv_shape_of(tiny, block_size)
        budget = RunnerBudget(block_size, device_blocks * shape.bytes_per_block, 0,
                              host_cache_bytes=host_blocks * shape.bytes_per_block,
                              disk_cache_path=None if disk is None else str(disk), disk_cache_bytes=64 << 20)
        runner = ModelRunner(tiny, budget)
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
        engine = Engine(Scheduler(config, runner.geometry), runner)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        await engine.shutdown()


async def run(engine: Engine, request_id: str, prompt: list[int], salt: str = "t") -> tuple[list[int], TokenEvent]:
    await engine.start()
    request = Request(RequestId(request_id), prompt, 8, cache_salt=salt)
    out: list[int] = []
    last: TokenEvent | None = None
    async for event in engine.submit(request):
        out.extend(event.new_token_ids)
        last = event
    assert last is not None and last.finish_reason == "length"
    return out, last


def prompts(count: int, length: int = 100) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


async def serve_all(engine: Engine, texts: list[list[int]], tag: str) -> list[tuple[list[int], int]]:
    results = []
    for index, text in enumerate(texts):
        out, last = await run(engine, f"{tag}{index}", text)
        results.append((out, last.num_cached_tokens))
    return results


async def test_blocks_written_down_and_copied_up_give_the_same_tokens(make_engine: EngineFactory) -> None:
    texts = prompts(4)  # 6 full blocks each; the device holds 16 blocks: the first prompt is pushed out
    roomy = make_engine(device_blocks=64)
    expected = await serve_all(roomy, texts + texts[:1], "r")
    assert expected[-1][1] == 96  # never evicted: all full blocks from the device

    tiered = make_engine(device_blocks=16, host_blocks=64)
    got = await serve_all(tiered, texts + texts[:1], "t")

    assert [out for out, _ in got] == [out for out, _ in expected]
    assert got[-1][1] == 96
    tiers = tiered.stats()["prefix_cache"]["tiers"]
    assert tiers["host"]["hits"] >= 6 and tiers["host"]["writes"] >= 6
    assert tiered.stats()["kv_blocks_in_use"] == 0


async def test_a_prefix_half_on_device_half_on_disk_is_served_right(make_engine: EngineFactory,
                                                                   tmp_path: Path) -> None:
    texts = prompts(5)
    roomy = make_engine(device_blocks=64)
    expected = await serve_all(roomy, texts + texts[:1], "r")
    engine = make_engine(device_blocks=16, host_blocks=8, disk=tmp_path)
    got = await serve_all(engine, texts + texts[:1], "d")

    assert [out for out, _ in got] == [out for out, _ in expected]
    assert got[-1][1] == 96
    assert engine.stats()["prefix_cache"]["tiers"]["disk"]["hits"] >= 1


async def test_a_restart_serves_a_prefix_from_disk(make_engine: EngineFactory, tmp_path: Path) -> None:
    texts = prompts(4)
    first = make_engine(device_blocks=16, host_blocks=64, disk=tmp_path)
    before = await serve_all(first, texts, "a")
    await first.shutdown()  # the disk tier finishes its writes

    again = make_engine(device_blocks=16, host_blocks=64, disk=tmp_path)
    out, last = await run(again, "b0", texts[0])

    assert out == before[0][0]
    assert last.num_cached_tokens == 96
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folders and all(stat.S_IMODE(os.stat(p).st_mode) == 0o700 for p in [tmp_path, *folders])
    files = [p for p in folders[0].iterdir() if p.is_file()]
    assert files and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in files)


async def test_a_disk_tier_of_another_block_size_is_ignored(make_engine: EngineFactory, tmp_path: Path) -> None:
    texts = prompts(4)
    first = make_engine(device_blocks=16, host_blocks=64, disk=tmp_path)
    await serve_all(first, texts, "a")
    await first.shutdown()

    other = make_engine(device_blocks=32, host_blocks=64, disk=tmp_path, block_size=8)
    _, last = await run(other, "b0", texts[0])

    assert last.num_cached_tokens == 0


async def test_tenants_get_their_own_blocks_in_every_tier(make_engine: EngineFactory, tmp_path: Path) -> None:
    texts = prompts(4)
    engine = make_engine(device_blocks=16, host_blocks=64, disk=tmp_path)
    await serve_all(engine, texts, "a")  # tenant "t"; the first prompt is now below the device

    _, other = await run(engine, "x", texts[0], salt="someone else")
    _, same = await run(engine, "y", texts[0])

    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 96
