"""Torch-free KV block accounting: which blocks are free, who holds what, reference counts, and
the prefix cache of full blocks.

The allocator reports, the policy decides: methods answer None or False when there is no room;
what to do about it is the scheduler's call.

What must stay true: a block with a reference is never in the free queue, so eviction (reusing a
free block that still holds a cached hash) never touches a block in use.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block with none left joins the free queue.
        Freed tail-first, so a sequence's last blocks are reused before its shared prefix."""
        for block in reversed(block_ids):
            if self._ref_counts[block] <= 0:
                raise AssertionError(f"block {block} freed more often than allocated")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

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


class KVBlockManager:
    """Device and CPU block pools, and the mapping of requests to blocks."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_counters = PrefixCacheCounters()

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so positions up to num_computed_tokens + num_new_tokens have a slot."""
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.device.num_free

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Give the request room for num_new_tokens more tokens; None (and no change) if there is none."""
        new_blocks = self.device.allocate(self.blocks_needed(request, num_new_tokens))
        if new_blocks is None:
            return None
        request.block_ids.extend(new_blocks)
        return new_blocks

    def take_cached_prefix(self, request: Request) -> int:
        """For a request with nothing computed: share the longest chain of cached full blocks and
        count them as computed. At least the last token is left to compute (its logits are needed).
        Returns the number of tokens taken from the cache."""
        if not self.enable_prefix_caching or request.num_computed_tokens or request.block_ids:
            return 0
        if request.sampling.prompt_logprobs is not None:  # every prompt position's logits are wanted
            return 0
        limit = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size,
                                     request.cache_salt, limit)
        for block_hash in hashes[:limit]:
            block = self.device.lookup(block_hash)
            if block is None:
                break
            self.device.share(block)
            request.block_ids.append(block)
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        request.num_registered_blocks = len(request.block_ids)
        return request.num_computed_tokens

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_counters.queried_tokens += request.num_tokens
            self.prefix_counters.hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size,
                                     request.cache_salt, num_full)
        for index in range(request.num_registered_blocks, num_full):
            self.device.register(request.block_ids[index], hashes[index])
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Return the request's device and CPU blocks (cached ones stay findable until reused)."""
        self.device.free(request.block_ids)
        self.cpu.free(request.cpu_block_ids)
        request.block_ids = []
        request.cpu_block_ids = []
        request.num_registered_blocks = 0

    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_ids) <= self.cpu.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU blocks; the copies to make, or None if the CPU pool is full."""
        cpu_blocks = self.cpu.allocate(len(request.block_ids))
        if cpu_blocks is None:
            return None
        pairs = list(zip(request.block_ids, cpu_blocks, strict=True))
        self.device.free(request.block_ids)
        request.block_ids, request.cpu_block_ids = [], cpu_blocks
        request.num_registered_blocks = 0
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return blocks <= self.device.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring the request's blocks back to the device; the copies to make, or None if no room."""
        device_blocks = self.device.allocate(len(request.cpu_block_ids))
        if device_blocks is None:
            return None
        pairs = list(zip(request.cpu_block_ids, device_blocks, strict=True))
        self.cpu.free(request.cpu_block_ids)
        request.block_ids, request.cpu_block_ids = device_blocks, []
        return pairs
