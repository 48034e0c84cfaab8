"""CPU-heavy work before the engine, off the event loop that serves every tenant's streams, and
behind the engine for the CPU.

Parsing a 4 MiB body, rendering a conversation of thousands of turns through the chat template or
tokenizing a long text holds the interpreter for a second or more. On the event loop, every other
tenant's stream would stop for that long between two chunks; in a worker thread the loop keeps its
turn (the interpreter switches threads every few milliseconds). Small work stays on the loop, where
a thread hop would cost more than the work.

The worker threads are this module's own, at a low CPU priority (nice 10): on a machine whose cores
the model's forward keeps busy, a storm of heavy requests gets about a tenth of what the forward gets,
instead of halving every stream's speed. Each tenant has one job in them at a time, the others waiting in its
queue, so that the threads go round the tenants: one tenant's storm waits behind itself. And each tenant's
jobs take at most `cpu_share` of one core on average: after a job of c CPU seconds, the tenant's next one
waits c * (1 / cpu_share - 1). Nice 10 alone still let a storm take what the forward leaves and more: a
neighbour tokenizing 1 MiB texts in four loops kept a worker thread at 0.15-0.23 of a core, and torch's two
threads fell from 0.88-0.97 of a core each to 0.69-0.84 (docs/loadtest.md).

The price: a low-priority thread that holds the interpreter lock (pydantic validates a large body in
stretches of tens of milliseconds without letting it go) can be kept off the CPU by busy threads of
normal priority, and the event loop waits for the lock meanwhile. Measured with the default model
beside a neighbour sending 50,000-item bodies, the light tenant's ITL p99 was 1.42x alone's at nice
10 (7.9x with the work at normal priority, two threads per tenant; 1.1x at nice 19, which starves
long prompts).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar, TypeVarTuple

logger = logging.getLogger(__name__)
R = TypeVar("R")
Ts = TypeVarTuple("Ts")

THREAD_BODY_BYTES = 64 * 1024  # a body this large is parsed and validated in a worker thread
THREAD_ITEMS = 256  # a conversation of more messages or items than this is prepared in a worker thread
THREAD_TOKENIZE_CHARS = 16_384  # text this long is tokenized in a worker thread
# nice 10: about a tenth of the CPU time of a normal-priority thread wanting the same core. Not 19 (about
# 1.5%), under which a busy engine would starve any tenant's long prompt for seconds.
PREPARE_NICE = 10
PREPARE_CPU_SHARE = 0.1  # of one core, each tenant's heavy jobs on average (settings: tenant_prepare_cpu_share)


def default_num_threads() -> int:
    return max(2, (os.cpu_count() or 2) // 2)


class OffLoop:
    def __init__(self, num_threads: int | None = None, nice: int = PREPARE_NICE,
                 cpu_share: float = PREPARE_CPU_SHARE) -> None:
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], not {cpu_share}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads or default_num_threads(),
                                        thread_name_prefix="fairlane-prepare", initializer=_at_low_priority,
                                        initargs=(nice,))
        self._turns: dict[str, asyncio.Semaphore] = {}  # each tenant's one job at a time
        self._pause_per_cpu_s = 1.0 / cpu_share - 1.0

    async def run_if(self, is_heavy: bool, tenant_id: str, work: Callable[[*Ts], R], *args: *Ts) -> R:
        """work(*args): in a worker thread, in the tenant's turn, when heavy; else here on the loop. The
        result comes back at once; the tenant's turn comes back after the job's pause (see the module)."""
        if not is_heavy:
            return work(*args)
        turn = self._turn(tenant_id)
        await turn.acquire()
        job = _TimedJob(functools.partial(work, *args))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        finally:
            self._give_back_later(turn, job.cpu_s * self._pause_per_cpu_s)

    @staticmethod
    def _give_back_later(turn: asyncio.Semaphore, pause_s: float) -> None:
        if pause_s <= 0:
            turn.release()
        else:
            asyncio.get_running_loop().call_later(pause_s, turn.release)

    def _turn(self, tenant_id: str) -> asyncio.Semaphore:
        turn = self._turns.get(tenant_id)
        if turn is None:
            turn = self._turns[tenant_id] = asyncio.Semaphore(1)
        return turn

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _TimedJob(Generic[R]):
    """A job that notes the CPU time its worker thread spent on it (0 until it has run)."""

    def __init__(self, call: Callable[[], R]) -> None:
        self._call = call
        self.cpu_s = 0.0

    def __call__(self) -> R:
        started = time.thread_time()
        try:
            return self._call()
        finally:
            self.cpu_s = time.thread_time() - started


def _at_low_priority(nice: int) -> None:
    """Lower this thread's CPU priority (Linux threads each have their own nice value)."""
    if nice == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: the work runs at normal priority
        logger.debug("worker threads keep their priority: %s", exc)
