"""Paced garbage collection: with pacing installed, the collector acts only when the engine asks, at
CPython's cadence, and an engine's steps hold no collection of their own."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from scheduling.gc_pacing import OLDER_EVERY, YOUNG_THRESHOLD, PacedCollector, paced_collection
from tests.factories import collect, make_fake_engine, make_request, running
from tests.isolation import call_in_fresh_process


@pytest.fixture
def paced() -> Iterator[list[tuple[int, bool]]]:
    with recorded_paced_collections() as started:
        yield started


@contextlib.contextmanager
def recorded_paced_collections() -> Iterator[list[tuple[int, bool]]]:
    """The serving collector; yields (generation, made by PacedCollector.collect_due) for each collection
    that starts. `paced_collection` puts the collector back as it was."""
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


def test_collections_come_when_asked_at_cpythons_cadence() -> None:
    """In a fresh process: another test's threads, allocating or freeing containers while this one counts
    its own, would shift CPython's cadence (a full suite run once saw one collection fewer)."""
    started, by_pacing_throughout, counts = call_in_fresh_process(paced_cadence)
    assert [generation for generation, _ in started] == [0] * (OLDER_EVERY + 1) + [1]
    assert by_pacing_throughout and all(by_pacing for _, by_pacing in started)  # the automatic collector stayed out
    assert counts == [OLDER_EVERY + 1, 1, 0]


def paced_cadence() -> tuple[list[tuple[int, bool]], bool, list[int]]:
    """The collections (generation, made by pacing) while new containers pass the young threshold
    OLDER_EVERY + 2 times, each followed by collect_due; whether none came unasked between; the
    collector's counts per generation."""
    with recorded_paced_collections() as started:
        collector, kept = PacedCollector(), list[list[list[int]]]()
        collector.collect_due()
        assert started == []  # nothing new yet
        by_pacing_throughout = True
        for _ in range(OLDER_EVERY + 2):  # a generation is due once its count is past the threshold
            kept.append([[] for _ in range(YOUNG_THRESHOLD + 1)])  # more new containers than the threshold
            by_pacing_throughout &= all(by_pacing for _, by_pacing in started)
            collector.collect_due()
        assert collector.seconds > 0
        return list(started), by_pacing_throughout, list(collector.collections)


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
