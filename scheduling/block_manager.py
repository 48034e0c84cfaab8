"""Torch-free KV block accounting: which blocks are free, who holds what, reference counts, and
the prefix cache of full blocks.

The allocator reports, the policy decides: methods answer None or False when there is no room;
what to do about it is the scheduler's call.

What must stay true: a block with a reference is never in the free queue, so eviction (reusing a
free block that still holds a cached hash) never touches a block in use.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from scheduling.prefix_cache import extend_block_hashes
from scheduling.request import Request


class BlockPool:
    """A fixed set of block ids with reference counts. Free blocks that hold a cached prefix stay
    findable until reused; the least recently freed is reused first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of_hash)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            taken.append(block)
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block with none left joins the free queue.
        Freed tail-first, so a sequence's last blocks are reused before its shared prefix."""
        for block in reversed(block_ids):
            if self._ref_counts[block] <= 0:
                raise AssertionError(f"block {block} freed more often than allocated")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def is_free(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of_hash.get(block_hash)

    def share(self, block: int) -> None:
        """Take a reference to a cached block (out of the free queue if it was there)."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Remember a full, computed block under its hash (the first block with a hash keeps it)."""
        if block_hash not in self._block_of_hash and block not in self._hash_of_block:
            self._block_of_hash[block_hash] = block
            self._hash_of_block[block] = block_hash

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]


@dataclass(slots=True)
class PrefixCacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)
class _BlockTable:
    """One request's blocks besides its device blocks (`KVBlockManager._device_tables`). Only the
    manager reads or writes it; the request holds none of it."""

    tenant_id: str
    cpu: list[int] = field(default_factory=list)  # while swapped out
    num_registered: int = 0  # leading device blocks already entered in the prefix cache


class KVBlockManager:
    """Device and CPU block pools, and every request's block table, keyed by request id.

    A request never holds block lists that other modules edit (vLLM's KV manager keeps them the
    same way). The scheduler asks pure questions (`cached_prefix`, `blocks_needed`,
    `can_swap_in`, `num_device_blocks`) and then makes one change (`allocate`, `swap_out`,
    `swap_in`, `free`) that either succeeds whole or changes nothing."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_counters = PrefixCacheCounters()
        self._tables: dict[str, _BlockTable] = {}
        # Each request's device blocks, in position order. A tuple, replaced when it grows (every block_size
        # tokens), so a plan can carry it by reference: no copy per sequence per step, and no later change
        # reaches a plan already built. The scheduler reads it for every running request at every step,
        # through `device_tables`, without a method call.
        self._device_tables: dict[str, tuple[int, ...]] = {}
        self.device_tables: Mapping[str, tuple[int, ...]] = MappingProxyType(self._device_tables)
        self._hashes: dict[str, list[bytes]] = {}  # each request's hash chain, grown lazily (derived data)
        self._device_blocks_by_tenant: Counter[str] = Counter()

    # ---- questions (change nothing) --------------------------------------------------------

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's device blocks, in position order (immutable: safe to keep)."""
        return self._device_tables.get(request_id, ())

    def cpu_blocks(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return list(table.cpu) if table else []

    def num_device_blocks(self, request_id: str) -> int:
        return len(self._device_tables.get(request_id, ()))

    def num_cpu_blocks(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table.cpu) if table else 0

    def num_registered_blocks(self, request_id: str) -> int:
        """Leading device blocks of the request already entered in the prefix cache."""
        table = self._tables.get(request_id)
        return table.num_registered if table else 0

    def device_blocks_held_by(self, tenant_id: str) -> int:
        return self._device_blocks_by_tenant[tenant_id]

    def blocks_needed(self, request: Request, num_new_tokens: int, num_computed: int | None = None) -> int:
        """Device blocks to add so positions up to num_computed + num_new_tokens have a slot."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - self.num_device_blocks(request.request_id))

    def cached_prefix(self, request: Request) -> tuple[int, ...]:
        """The leading full blocks of a request holding nothing that the prefix cache already has.
        At least the last token is left to compute (its logits are needed)."""
        if (not self.enable_prefix_caching or request.num_computed_tokens or request.request_id in self._tables
                or request.sampling.prompt_logprobs is not None):  # every prompt position's logits are wanted
            return ()
        limit = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in self._hash_chain(request, limit)[:limit]:
            block = self.device.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return tuple(found)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return blocks <= self.device.num_free

    def can_swap_out(self, request: Request) -> bool:
        return self.num_device_blocks(request.request_id) <= self.cpu.num_free

    # ---- changes (whole or nothing) --------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: tuple[int, ...] = ()) -> bool:
        """Give the request room for num_new_tokens more tokens, first sharing `cached_prefix` (from
        `cached_prefix()`, for a request holding nothing). False, and nothing changed, if it does not fit."""
        held = self._device_tables.get(request.request_id, ())
        if -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) <= len(held) and held:
            return True  # the common decode: the last block still has room (and nothing is shared when holding)
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_fresh = self.blocks_needed(request, num_new_tokens, num_computed) - len(cached_prefix)
        # A cached block nobody holds sits in the free queue: sharing it takes it out.
        if num_fresh + sum(self.device.is_free(b) for b in cached_prefix) > self.device.num_free:
            return False
        table = self._tables.setdefault(request.request_id, _BlockTable(request.tenant_id))
        for block in cached_prefix:
            self.device.share(block)
        fresh = self.device.allocate(num_fresh)
        assert fresh is not None  # checked above
        self._device_tables[request.request_id] = (*held, *cached_prefix, *fresh)
        table.num_registered = max(table.num_registered, len(cached_prefix))
        self._device_blocks_by_tenant[table.tenant_id] += len(cached_prefix) + len(fresh)
        return True

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_counters.queried_tokens += request.num_tokens
            self.prefix_counters.hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks so later requests can share them."""
        table = self._tables.get(request.request_id)
        if not self.enable_prefix_caching or table is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= table.num_registered:
            return
        hashes = self._hash_chain(request, num_full)
        device = self._device_tables[request.request_id]
        for index in range(table.num_registered, num_full):
            self.device.register(device[index], hashes[index])
        table.num_registered = num_full

    def free(self, request_id: str) -> None:
        """Return the request's device and CPU blocks (cached ones stay findable until reused)."""
        table = self._tables.pop(request_id, None)
        device = self._device_tables.pop(request_id, ())
        if table is not None:
            self.device.free(device)
            self.cpu.free(table.cpu)
            self._device_blocks_by_tenant[table.tenant_id] -= len(device)
        self._hashes.pop(request_id, None)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU blocks; the copies to make, or None if the CPU pool is full."""
        table, device = self._tables[request.request_id], self._device_tables[request.request_id]
        cpu_blocks = self.cpu.allocate(len(device))
        if cpu_blocks is None:
            return None
        pairs = list(zip(device, cpu_blocks, strict=True))
        self.device.free(device)
        self._device_blocks_by_tenant[table.tenant_id] -= len(device)
        self._device_tables[request.request_id] = ()
        table.cpu, table.num_registered = cpu_blocks, 0
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring the request's blocks back to the device; the copies to make, or None if no room."""
        table = self._tables[request.request_id]
        device_blocks = self.device.allocate(len(table.cpu))
        if device_blocks is None:
            return None
        pairs = list(zip(table.cpu, device_blocks, strict=True))
        self.cpu.free(table.cpu)
        self._device_tables[request.request_id] = tuple(device_blocks)
        table.cpu = []
        self._device_blocks_by_tenant[table.tenant_id] += len(device_blocks)
        self.cache_computed_blocks(request)  # so every computed full block is registered (see Scheduler.update)
        return pairs

    def _hash_chain(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.get(request.request_id)
        if hashes is None:  # starts from the prompt's chain when the engine made it at submission
            hashes = self._hashes[request.request_id] = list(request.prompt_block_hashes)
        return extend_block_hashes(hashes, request.token_ids, self.block_size, request.cache_salt, num_blocks)
