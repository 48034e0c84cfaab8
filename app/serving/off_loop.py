"""CPU-heavy work before the engine, off the event loop that serves every tenant's streams.

Parsing a 4 MiB body, rendering a conversation of thousands of turns through the chat template or
tokenizing a long text holds the interpreter for a second or more. On the event loop, every other
tenant's stream would stop for that long between two chunks; in a worker thread the loop keeps its
turn (the interpreter switches threads every few milliseconds). Each tenant has a few such jobs at a
time: one tenant's storm of heavy bodies waits behind itself and leaves the threads to the others.
Small work stays on the loop, where a thread hop would cost more than the work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

R = TypeVar("R")
Ts = TypeVarTuple("Ts")

THREAD_BODY_BYTES = 64 * 1024  # a body this large is parsed and validated in a worker thread
THREAD_ITEMS = 256  # a conversation of more messages or items than this is prepared in a worker thread
THREAD_TOKENIZE_CHARS = 16_384  # text this long is tokenized in a worker thread
THREADS_PER_TENANT = 2


class OffLoop:
    def __init__(self, threads_per_tenant: int = THREADS_PER_TENANT) -> None:
        self.threads_per_tenant = threads_per_tenant
        self._limiters: dict[str, anyio.CapacityLimiter] = {}

    async def run_if(self, is_heavy: bool, tenant_id: str, work: Callable[[*Ts], R], *args: *Ts) -> R:
        """work(*args): in one of the tenant's worker threads when heavy, else here on the loop."""
        if not is_heavy:
            return work(*args)
        return await anyio.to_thread.run_sync(work, *args, limiter=self._limiter(tenant_id))

    def _limiter(self, tenant_id: str) -> anyio.CapacityLimiter:
        limiter = self._limiters.get(tenant_id)
        if limiter is None:
            limiter = self._limiters[tenant_id] = anyio.CapacityLimiter(self.threads_per_tenant)
        return limiter
