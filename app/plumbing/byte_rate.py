"""Each tenant's file transfers shaped to a byte rate: uploads read, and file content sent, no faster
than `bytes_per_s` per tenant, all its transfers together (a token bucket a second deep).

Moving a file's bytes costs the server's CPU (the socket copies, the multipart parser, SQLite), on a
small machine the same cores the model's forward runs on: measured on 2 vCPUs, one tenant moving 16 MiB
files in and out as fast as it could made another tenant's streams 2.5x slower between tokens. Shaped,
a transfer takes longer for its own tenant only; nothing is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from tenancy.quotas import TokenBucket


class ByteRate:
    def __init__(self, bytes_per_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}  # each tenant's bytes available, a second deep

    def delay_for(self, tenant_id: str, num_bytes: int) -> float:
        """Take num_bytes from the tenant's bucket; the seconds to wait before moving them (the bucket
        may go below zero: a chunk larger than a second's worth waits for its whole cost)."""
        now = self._clock()
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            rate = float(self.bytes_per_s)
            bucket = self._buckets[tenant_id] = TokenBucket(rate, rate, now, window_s=1.0)
        bucket.refill(now)
        bucket.level -= num_bytes
        return bucket.seconds_until(0.0)

    async def shaped(self, tenant_id: str, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        """The chunks, each after the wait its bytes cost the tenant."""
        async for chunk in chunks:
            delay = self.delay_for(tenant_id, len(chunk))
            if delay > 0:
                await asyncio.sleep(delay)
            yield chunk
