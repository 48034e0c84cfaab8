"""Garbage collection paced by the engine's steps instead of by wherever an allocation trips it.

CPython collects its young generation as soon as 700 more containers were made than freed, even if
they are about to be freed; after 10 of those the next one takes the middle generation too, and
after 10 of those the whole heap. A busy step has more than a thousand containers alive at once (a
sequence and an event per running request), so a young collection landed inside nearly every
`schedule()` or `update()` (0.1 to 0.3 ms here at 256 running), a middle one (about 0.5 ms) every
dozen steps, and a full one (over 10 ms with a thousand requests in flight) every 150 or so,
stalling every stream at once. Asked between steps, the collector finds most of those containers
already freed, and collects far less often.

With pacing installed (`paced_collection`: `fairlane serve` after start-up, with `gc.freeze()`), the
automatic collector only acts as a safety net, past `SAFETY_NET_THRESHOLD` containers (for traffic
while no step runs), and the engine collects itself, at CPython's cadence counted between steps,
while the runner's thread computes a step: the scheduler's path then holds no collection. What
stays shared is the interpreter lock, which a collection holds; the runner's thread needs it only
between kernels (on a GPU it mostly waits for the device, without it). vLLM keeps its engine loop
and its model workers in separate processes, where this question does not arise.

CPython also skips a full collection while fewer than a quarter of the long-lived objects are new;
that count is not visible from Python, so a paced full collection comes after every 10 middle ones.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 700  # CPython's default: new containers that make a young collection due
OLDER_EVERY = 10  # CPython's default: collections of one generation per collection of the next
SAFETY_NET_THRESHOLD = 50_000  # the automatic collector's threshold while pacing is installed


@contextmanager
def paced_collection() -> Iterator[None]:
    """A serving process's collector, for as long as it serves (`fairlane serve`, and the benchmarks
    that stand in for it): what exists now (the model, the tokenizer, the modules) stays out of every
    collection, and young collections are left to the engine's steps. Process-wide; undone on exit, so
    a caller in the same process (a test) gets its collector back as it was."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(SAFETY_NET_THRESHOLD, OLDER_EVERY, OLDER_EVERY)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class PacedCollector:
    """Makes, when asked, the collection CPython would have made by now: none until more than
    `YOUNG_THRESHOLD` containers are new. Counts what it collected, for the engine's stats."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation
        self.seconds = 0.0

    def collect_due(self) -> None:
        num_new, young_since_middle, middle_since_full = gc.get_count()
        if num_new <= YOUNG_THRESHOLD:  # CPython's comparisons: a generation is due past its threshold
            return
        if middle_since_full > OLDER_EVERY:
            generation = 2
        elif young_since_middle > OLDER_EVERY:
            generation = 1
        else:
            generation = 0
        started = time.perf_counter()
        gc.collect(generation)
        self.seconds += time.perf_counter() - started
        self.collections[generation] += 1
