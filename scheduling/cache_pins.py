"""Explicit cache breakpoints: prefixes a request asked to keep (Anthropic's `cache_control`), for a TTL.

A pinned block is not chosen for eviction in any tier while its pin lasts: the device pool reuses other
free blocks first, and the host and disk tiers evict other entries first. Pins never hold back
admission: when only pinned blocks are free, the device pool reuses them anyway (the least recently
freed first), and a pinned block that leaves the device is written down like any other. Pins are keyed
by block hash, so a pin follows its block through the tiers; the hash holds the tenant's salt, so a pin
is the tenant's own. Each tenant may pin at most `max_blocks_per_tenant` blocks at once: past that a
breakpoint is an ordinary prefix, cached as long as nothing needs its blocks. In the host and disk
tiers a pin keeps its entry only within shares of the tier (cache_tiers.py's TierIndex): pins together
keep at most half of a tier, one tenant's at most a quarter, so that no tenant's pins crowd the other
tenants' blocks out of a tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable


class CachePins:
    def __init__(self, max_blocks_per_tenant: int, clock: Callable[[], float]) -> None:
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self._clock = clock
        self._until: dict[bytes, float] = {}
        self._tenant_of: dict[bytes, str] = {}
        self._per_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._until)

    def pin(self, tenant_id: str, hashes: Iterable[bytes], ttl_s: float) -> int:
        """Pin (or keep pinned for longer) the blocks of these hashes; returns how many were pinned anew.
        Blocks past the tenant's quota stay unpinned."""
        until = self._clock() + ttl_s
        added = 0
        for block_hash in hashes:
            if block_hash in self._until:
                self._until[block_hash] = max(self._until[block_hash], until)
                continue
            if self._per_tenant[tenant_id] >= self.max_blocks_per_tenant:
                break
            self._until[block_hash] = until
            self._tenant_of[block_hash] = tenant_id
            self._per_tenant[tenant_id] += 1
            added += 1
        return added

    def is_pinned(self, block_hash: bytes) -> bool:
        if not self._until:  # the common case, asked at every block the device pool reuses: no clock read
            return False
        until = self._until.get(block_hash)
        return until is not None and until > self._clock()

    def owner_of(self, block_hash: bytes) -> str | None:
        """The tenant whose pin keeps this block now; None when no pin does."""
        return self._tenant_of.get(block_hash) if self.is_pinned(block_hash) else None

    def pinned_by(self, tenant_id: str) -> int:
        return self._per_tenant[tenant_id]

    def expire(self) -> None:
        """Forget pins past their TTL (their blocks are ordinary cached blocks again)."""
        now = self._clock()
        for block_hash in [h for h, until in self._until.items() if until <= now]:
            del self._until[block_hash]
            tenant_id = self._tenant_of.pop(block_hash)
            self._per_tenant[tenant_id] -= 1
            if not self._per_tenant[tenant_id]:
                del self._per_tenant[tenant_id]
