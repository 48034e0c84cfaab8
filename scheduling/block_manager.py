"""Torch-free KV block accounting: which blocks are free, who holds what, reference counts, and
the prefix cache of full blocks.

The allocator reports, the policy decides: methods answer None or False when there is no room;
what to do about it is the scheduler's call.

What must stay true: a block with a reference is never in the free queue, so eviction (reusing a
free block that still holds a cached hash) never touches a block in use.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from contract.plan import TierCopies
from scheduling.cache_pins import CachePins
from scheduling.cache_tiers import LowerTiers
from scheduling.prefix_cache import extend_block_hashes
from scheduling.request import PriorityClass, Request


class BlockPool:
    """A fixed set of block ids with reference counts. Free blocks that hold a cached prefix stay
    findable until reused; the least recently freed is reused first."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None,
                 is_pinned: Callable[[bytes], bool] | None = None) -> None:
        self.num_blocks = num_blocks
        self.on_evict = on_evict  # told of each cached block about to be reused, before it is
        self.is_pinned = is_pinned  # a free cached block pinned by a breakpoint is reused after the others
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
            block = self._take_free()
            self._evict(block)
            self._ref_counts[block] = 1
            taken.append(block)
        return taken

    def _take_free(self) -> int:
        """The least recently freed block, passing over pinned ones while others are free."""
        if self.is_pinned is not None and self._hash_of_block:
            hash_of, is_pinned, free = self._hash_of_block, self.is_pinned, self._free
            for _ in range(len(free)):
                block = next(iter(free))
                block_hash = hash_of.get(block)
                if block_hash is None or not is_pinned(block_hash):
                    break
                free.move_to_end(block)  # kept for later: most recently freed now
        block, _ = self._free.popitem(last=False)
        return block

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
            if self.on_evict is not None:
                self.on_evict(block, block_hash)


@dataclass(slots=True)
class PrefixCacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)
class _BlockTable:
    """One request's blocks besides its device blocks (`KVBlockManager._device_tables`). Only the
    manager reads or writes it; the request holds none of it."""

    owner: tuple[str, PriorityClass]  # the tenant and class whose blocks these are (for the KV share rule)
    cpu: list[int] = field(default_factory=list)  # while swapped out
    num_registered: int = 0  # leading device blocks already entered in the prefix cache


class KVBlockManager:
    """Device and CPU block pools, and every request's block table, keyed by request id.

    A request never holds block lists that other modules edit (vLLM's KV manager keeps them the
    same way). The scheduler asks pure questions (`cached_prefix`, `blocks_needed`,
    `blocks_to_swap_in`, `num_device_blocks`) and then makes one change (`allocate`, `swap_out`,
    `swap_in`, `free`) that either succeeds whole or changes nothing."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, tiers: LowerTiers | None = None,
                 pins: CachePins | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The prefix cache's host and disk tiers: a cached device block is written down when reused.
        self.tiers = tiers if tiers is not None and tiers.enabled and enable_prefix_caching else None
        self.pins = pins if enable_prefix_caching else None  # cache breakpoints (scheduling/cache_pins.py)
        self.device = BlockPool(num_device_blocks, self._write_down if self.tiers is not None else None,
                                None if self.pins is None else self.pins.is_pinned)
        self.cpu = BlockPool(num_cpu_blocks)
        self.prefix_counters = PrefixCacheCounters()
        self._tables: dict[str, _BlockTable] = {}
        # Each request's device blocks, in position order. A tuple, replaced when it grows (every block_size
        # tokens), so a plan can carry it by reference: no copy per sequence per step, and no later change
        # reaches a plan already built. The scheduler reads it for every running request at every step,
        # through `device_tables`, without a method call.
        self._device_tables: dict[str, tuple[int, ...]] = {}
        self.device_tables: Mapping[str, tuple[int, ...]] = MappingProxyType(self._device_tables)
        self._hashes: dict[str, list[bytes]] = {}  # each request's hash chain, grown lazily (derived data)
        self._device_blocks_by_owner: Counter[tuple[str, PriorityClass]] = Counter()  # per tenant and class

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

    def device_blocks_held_by(self, tenant_id: str, priority: PriorityClass | None = None) -> int:
        """Device blocks held by the tenant's requests of one class, or of every class (None)."""
        if priority is not None:
            return self._device_blocks_by_owner[(tenant_id, priority)]
        return sum(self._device_blocks_by_owner[(tenant_id, p)] for p in PriorityClass)

    def blocks_needed(self, request: Request, num_new_tokens: int, num_computed: int | None = None) -> int:
        """Device blocks to add so positions up to num_computed + num_new_tokens have a slot."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - self.num_device_blocks(request.request_id))

    def cached_prefix(self, request: Request) -> tuple[int, ...]:
        """The leading full blocks of a request holding nothing that the prefix cache already has on the
        device. At least the last token is left to compute (its logits are needed)."""
        if not self._may_share(request):
            return ()
        found = []
        for block_hash in self._shareable_chain(request):
            block = self.device.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return tuple(found)

    def host_prefix(self, request: Request, num_device_hits: int) -> list[bytes]:
        """The hashes of the blocks in host memory that continue the request's cached prefix after its
        `num_device_hits` device blocks: copied up when it is admitted (see `allocate`)."""
        if self.tiers is None or not self._may_share(request):
            return []
        chain = self._shareable_chain(request)[num_device_hits:]
        return chain[:len(self.tiers.find(chain)[0])]

    def read_from_disk(self, request: Request) -> bool:
        """Plan reads into host memory of the blocks that continue the request's cached prefix only on
        disk. True when some were planned: the request is admitted at a later step, once they are in host
        memory (a read that fails then is only a shorter hit)."""
        if self.tiers is None or not self.tiers.disk.capacity or not self._may_share(request):
            return False
        chain = self._shareable_chain(request)[len(self.cached_prefix(request)):]
        return self.tiers.read_continuation(chain) > 0

    def _may_share(self, request: Request) -> bool:
        """Whether a request may start from cached blocks: one holding nothing yet, and not asking for
        every prompt position's logits."""
        return (self.enable_prefix_caching and not request.num_computed_tokens
                and request.request_id not in self._tables and request.sampling.prompt_logprobs is None)

    def _shareable_chain(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks but the one holding its last token."""
        limit = (request.num_tokens - 1) // self.block_size
        return self._hash_chain(request, limit)[:limit]

    def blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks a swapped request takes to resume with num_new_tokens: its own back, and the new."""
        return -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_device_blocks(request.request_id) <= self.cpu.num_free

    # ---- changes (whole or nothing) --------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: tuple[int, ...] = (),
                 copied_up: Sequence[bytes] = ()) -> bool:
        """Give the request room for num_new_tokens more tokens, first sharing `cached_prefix` (from
        `cached_prefix()`, for a request holding nothing), then copying up the host blocks of `copied_up`
        (from `host_prefix()`) into fresh device blocks. False, and nothing changed, if it does not fit."""
        held = self._device_tables.get(request.request_id, ())
        if -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) <= len(held) and held:
            return True  # the common decode: the last block still has room (and nothing is shared when holding)
        num_hits = len(cached_prefix) + len(copied_up)
        num_computed = request.num_computed_tokens + num_hits * self.block_size
        num_fresh = self.blocks_needed(request, num_new_tokens, num_computed) - len(cached_prefix)
        # A cached block nobody holds sits in the free queue: sharing it takes it out.
        if num_fresh + sum(self.device.is_free(b) for b in cached_prefix) > self.device.num_free:
            return False
        table = self._tables.setdefault(request.request_id, _BlockTable((request.tenant_id, request.priority)))
        for block in cached_prefix:
            self.device.share(block)
        if copied_up:
            assert self.tiers is not None
            for block_hash in copied_up:  # busy: the write-downs of this allocation must not evict them
                self.tiers.host.touch(block_hash)
        fresh = self.device.allocate(num_fresh)
        assert fresh is not None  # checked above
        if copied_up:
            self._copy_up(copied_up, fresh[:len(copied_up)])
        self._device_tables[request.request_id] = (*held, *cached_prefix, *fresh)
        table.num_registered = max(table.num_registered, num_hits)
        self._device_blocks_by_owner[table.owner] += len(cached_prefix) + len(fresh)
        return True

    def _copy_up(self, chain: Sequence[bytes], device_blocks: list[int]) -> None:
        """Host blocks into fresh device blocks, registered in the device's prefix cache at once: the copies
        are made before the step's forward, so a request admitted later in the same step may share them."""
        assert self.tiers is not None
        self.tiers.copy_up(list(chain), device_blocks)
        for block, block_hash in zip(device_blocks, chain, strict=True):
            self.device.register(block, block_hash)

    def take_tier_copies(self) -> TierCopies:
        """The copies between tiers planned since the last call (for the step's plan)."""
        return self.tiers.take_copies() if self.tiers is not None else TierCopies()

    def tiers_lost(self, lost: Sequence[bytes], failed_reads: Sequence[bytes]) -> None:
        """What the runner could not keep on disk or read from it (see StepResult)."""
        if self.tiers is not None:
            self.tiers.lost(lost)
            self.tiers.failed_reads(failed_reads)

    def _write_down(self, block: int, block_hash: bytes) -> None:
        assert self.tiers is not None
        self.tiers.write_down(block, block_hash)

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
        first_new = table.num_registered
        for index in range(first_new, num_full):
            self.device.register(device[index], hashes[index])
        table.num_registered = num_full
        if first_new < request.cache_pin_tokens // self.block_size:  # blocks before its breakpoint were completed
            self.pin_breakpoint(request)

    def pin_breakpoint(self, request: Request) -> None:
        """Pin, or keep pinned for another TTL, the request's registered blocks before its breakpoint."""
        table = self._tables.get(request.request_id)
        if self.pins is None or not request.cache_pin_tokens or table is None:
            return
        count = min(request.cache_pin_tokens // self.block_size, table.num_registered)
        if count:
            self.pins.pin(request.tenant_id, self._hash_chain(request, count)[:count], request.cache_pin_ttl_s)

    def trim(self, request: Request) -> int:
        """Give back the device blocks past those its tokens need (proposed tokens a verification rejected
        had slots there); how many. Only blocks never registered can be past them: a block is registered
        once its tokens are computed, and rejected tokens never are."""
        held = self._device_tables.get(request.request_id, ())
        keep = -(-len(request.token_ids) // self.block_size)
        if len(held) <= keep:
            return 0
        table = self._tables[request.request_id]
        assert table.num_registered <= keep
        self.device.free(held[keep:])
        self._device_tables[request.request_id] = held[:keep]
        self._device_blocks_by_owner[table.owner] -= len(held) - keep
        return len(held) - keep

    def free(self, request_id: str) -> None:
        """Return the request's device and CPU blocks (cached ones stay findable until reused)."""
        table = self._tables.pop(request_id, None)
        device = self._device_tables.pop(request_id, ())
        if table is not None:
            self.device.free(device)
            self.cpu.free(table.cpu)
            self._device_blocks_by_owner[table.owner] -= len(device)
        self._hashes.pop(request_id, None)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU blocks; the copies to make, or None if the CPU pool is full."""
        table, device = self._tables[request.request_id], self._device_tables[request.request_id]
        cpu_blocks = self.cpu.allocate(len(device))
        if cpu_blocks is None:
            return None
        pairs = list(zip(device, cpu_blocks, strict=True))
        self.device.free(device)
        self._device_blocks_by_owner[table.owner] -= len(device)
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
        self._device_blocks_by_owner[table.owner] += len(device_blocks)
        self.cache_computed_blocks(request)  # so every computed full block is registered (see Scheduler.update)
        return pairs

    def _hash_chain(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.get(request.request_id)
        if hashes is None:  # starts from the prompt's chain when the engine made it at submission
            hashes = self._hashes[request.request_id] = list(request.prompt_block_hashes)
        return extend_block_hashes(hashes, request.token_ids, self.block_size, request.cache_salt, num_blocks)
