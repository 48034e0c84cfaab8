"""Paced garbage collection: with pacing installed, the collector acts only when the engine asks, at
CPython's cadence, and an engine's steps hold no collection of their own."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from scheduling.gc_pacing import OLDER_EVERY, YOUNG_THRESHOLD, PacedCollector, paced_collection
from tests.factories import collect, make_fake_engine, make_request, running


@pytest.fixture
def paced() -> Iterator[list[tuple[int, bool]]]:
    """The serving collector for the test; yields (generation, made by PacedCollector.collect_due) for
    each collection that starts. `paced_collection` puts the collector back as it was."""
    gc.collect()
    started: list[tuple[int, bool]] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append((info["generation"], made_by_pacing(sys._getframe(1))))

    with paced_collection():
        gc.callbacks.append(record)
        try:
            yield started
        finally:
            gc.callbacks.remove(record)


def made_by_pacing(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code is PacedCollector.collect_due.__code__:
            return True
        frame = frame.f_back
    return False


def test_collections_come_when_asked_at_cpythons_cadence(paced: list[tuple[int, bool]]) -> None:
    collector, kept = PacedCollector(), list[list[list[int]]]()
    collector.collect_due()
    assert paced == []  # nothing new yet
    for _ in range(OLDER_EVERY + 2):  # a generation is due once its count is past the threshold
        kept.append([[] for _ in range(YOUNG_THRESHOLD + 1)])  # more new containers than the threshold
        assert all(by_pacing for _, by_pacing in paced)  # the automatic collector stayed out
        collector.collect_due()
    assert [generation for generation, _ in paced] == [0] * (OLDER_EVERY + 1) + [1]
    assert all(by_pacing for _, by_pacing in paced)
    assert collector.collections == [OLDER_EVERY + 1, 1, 0] and collector.seconds > 0


async def test_an_engine_collects_only_while_the_runner_computes(paced: list[tuple[int, bool]]) -> None:
    engine = make_fake_engine(num_blocks=1024)
    async with running(engine):
        streams = [engine.submit(make_request(16, 8)) for _ in range(200)]  # thousands of live containers
        for stream in streams:
            events = await collect(stream)
            assert events[-1].finish_reason == "length"
    assert paced and all(by_pacing for _, by_pacing in paced)
    assert sum(engine.collector.collections) == len(paced)
    assert engine.stats()["paced_gc"]["collections_by_generation"] == engine.collector.collections
