"""Torch-free accounting of the prefix cache's lower tiers: host memory and disk, under the device pool.

A full block that leaves the device pool (its free block reused for something else) is written down
instead of lost: copied to a host block, and from there queued for a disk file. A request whose hash
chain goes on below the device is served from there: host blocks are copied up into device blocks
before its prefill (in the same step), disk blocks are first read into host blocks (one step ahead:
the request waits a step, so a file that cannot be read is only a shorter hit, recomputed).

The tiers are inclusive downwards: a block on the device may also be in host memory and on disk, and
every host block is written to disk when a disk tier is set (write-through), so a restart finds on disk
whatever was ever evicted. The swap pool of preempted requests is apart (`KVBlockManager.cpu`): a
swapped request's blocks must never be evicted, while every block here may be.

This module decides which block goes where and records the copies for the runner, which makes them
in a fixed order before the forward (see `contract.plan.TierCopies`); the runner stores bytes and nothing else.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from contract.plan import TierCopies

DISK_SLOT = 0  # a disk entry has no slot: files are named by their hash


@dataclass(slots=True)
class TierCounters:
    hits: int = 0  # blocks found here for a request (and copied up)
    writes: int = 0  # blocks written into this tier
    evictions: int = 0  # blocks dropped to make room
    lost: int = 0  # blocks the runner could not keep (a write dropped or failed, a read that failed)


class TierIndex:
    """One tier's blocks by hash, least recently used first, with a slot each (a host block id; disk
    entries have none). Entries touched in the current step are busy: never evicted before the step's
    copies are made, so no slot is written and read, or written twice, within one plan."""

    def __init__(self, name: str, capacity: int, has_slots: bool,
                 pin_owner: Callable[[bytes], str | None] | None = None) -> None:
        self.name = name
        self.capacity = capacity
        # The entries pins may keep from eviction: all pins together, and one tenant's (see _victim).
        self.max_kept_by_pins = max(1, capacity // 2)
        self.max_kept_by_tenant_pins = max(1, capacity // 4)
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1)) if has_slots else []
        self._has_slots = has_slots
        self._busy: set[bytes] = set()
        # Entries being filled from outside the steps (a decode replica's KV hand-off, cluster/handoff.py):
        # never evicted, and not found, until released.
        self.held: set[bytes] = set()
        self._pin_owner = pin_owner or (lambda _: None)
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def slot(self, block_hash: bytes) -> int | None:
        return self._entries.get(block_hash)

    def hashes(self) -> list[bytes]:
        return list(self._entries)

    def touch(self, block_hash: bytes) -> None:
        """Most recently used now, and busy until the step's copies are made."""
        self._entries.move_to_end(block_hash)
        self._busy.add(block_hash)

    def insert(self, block_hash: bytes) -> tuple[int, bytes | None] | None:
        """A slot for a new entry, evicting the least recently used one that is neither busy nor pinned.
        Returns (slot, evicted hash), or None when every entry is busy or pinned."""
        evicted = None
        if len(self._entries) >= self.capacity:
            evicted = self._victim()
            if evicted is None:
                return None
            self.remove(evicted)
            self.counters.evictions += 1
        slot = self._free_slots.pop() if self._has_slots else DISK_SLOT
        self._entries[block_hash] = slot
        self._busy.add(block_hash)
        self.counters.writes += 1
        return slot, evicted

    def remove(self, block_hash: bytes) -> None:
        slot = self._entries.pop(block_hash, None)
        if slot is not None and self._has_slots:
            self._free_slots.append(slot)

    def step_done(self) -> None:
        """The step's copies are planned: nothing is busy any more."""
        self._busy.clear()

    def _victim(self) -> bytes | None:
        """The least recently used entry that is neither busy nor kept by a pin. A pin keeps its entry
        only within the tier's shares: the least recently used pinned entries first, up to a quarter
        of the tier per tenant and half of it in all; a pinned entry past those is evicted like any."""
        num_kept = 0
        kept_by: Counter[str] = Counter()
        for block_hash in self._entries:
            if block_hash in self._busy or block_hash in self.held:
                continue
            owner = self._pin_owner(block_hash)
            if owner is None or num_kept >= self.max_kept_by_pins or kept_by[owner] >= self.max_kept_by_tenant_pins:
                return block_hash
            num_kept += 1
            kept_by[owner] += 1
        return None


class LowerTiers:
    """The host and disk tiers of one KV block manager, and the copies they ask of the next step."""

    def __init__(self, num_host_blocks: int, num_disk_blocks: int, disk_hashes: Iterable[bytes] = (),
                 pin_owner: Callable[[bytes], str | None] | None = None) -> None:
        self.host = TierIndex("host", num_host_blocks, has_slots=True, pin_owner=pin_owner)
        self.disk = TierIndex("disk", num_disk_blocks, has_slots=False, pin_owner=pin_owner)
        for block_hash in disk_hashes:  # what the disk held at start, oldest first
            if self.disk.insert(block_hash) is None:
                break
        self.disk.counters.writes = 0  # found at start, not written by this server
        self.disk.step_done()
        self.copies = TierCopies()
        self._being_read: set[bytes] = set()  # read into host blocks by this step: not there before its reads

    @property
    def enabled(self) -> bool:
        return self.host.capacity > 0

    def write_down(self, device_block: int, block_hash: bytes) -> None:
        """A cached device block is about to be reused: keep its contents in host memory (and on disk)."""
        if not self.enabled:
            return
        if block_hash in self.host:
            self.host.touch(block_hash)
            return
        placed = self.host.insert(block_hash)
        if placed is None:
            return  # every host block is busy or pinned: this one is lost, as without tiers
        host_block, _ = placed
        self.copies.offloads.append((device_block, host_block))
        self._write_to_disk(host_block, block_hash)

    def _write_to_disk(self, host_block: int, block_hash: bytes) -> None:
        if not self.disk.capacity or block_hash in self.disk:
            return
        placed = self.disk.insert(block_hash)
        if placed is None:
            return
        _, evicted = placed
        if evicted is not None:
            self.copies.disk_deletes.append(evicted)
        self.copies.disk_writes.append((host_block, block_hash))

    def find(self, chain: list[bytes]) -> tuple[list[int], list[bytes]]:
        """How the chain goes on below the device: the host blocks that continue it, in order, then the
        hashes after them that only the disk has. A block this step reads from disk is in neither: its
        read may fail, and copied up in the same step it would be served unread."""
        host_blocks: list[int] = []
        index = 0
        while (index < len(chain) and chain[index] not in self._being_read and chain[index] not in self.host.held
               and (slot := self.host.slot(chain[index])) is not None):
            host_blocks.append(slot)
            index += 1
        on_disk = []
        while index < len(chain) and chain[index] in self.disk:
            on_disk.append(chain[index])
            index += 1
        return host_blocks, on_disk

    def copy_up(self, chain: list[bytes], device_blocks: list[int]) -> None:
        """Plan the copies of host blocks (the chain's, found by `find`) into freshly allocated device blocks."""
        for block_hash, device_block in zip(chain, device_blocks, strict=True):
            host_block = self.host.slot(block_hash)
            assert host_block is not None
            self.host.touch(block_hash)
            self.host.counters.hits += 1
            self.copies.onloads.append((host_block, device_block))

    def read_continuation(self, chain: list[bytes]) -> int:
        """Plan reads of the disk blocks that continue the chain after its host blocks; how many. The host
        blocks are kept (busy) meanwhile: room for the reads is never made by evicting the chain's own
        blocks, so each call brings more of the chain up or plans nothing (the request is admitted then,
        with the part that is in host memory)."""
        host_blocks, on_disk = self.find(chain)
        if not on_disk:
            return 0
        for block_hash in chain[:len(host_blocks)]:
            self.host.touch(block_hash)
        return self.read_from_disk(on_disk)

    def read_from_disk(self, hashes: list[bytes]) -> int:
        """Plan reads of disk blocks into host blocks; a later step copies them up. Returns how many."""
        planned = 0
        for block_hash in hashes:
            placed = self.host.insert(block_hash)
            if placed is None:
                break
            self.disk.touch(block_hash)
            self.disk.counters.hits += 1
            self.copies.disk_reads.append((block_hash, placed[0]))
            self._being_read.add(block_hash)
            planned += 1
        return planned

    def hold_for_import(self, hashes: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """Host blocks for blocks that arrive from outside the steps (another replica's prefill): each
        hash not in host memory yet gets a slot, held (neither found nor evicted) until `release_imports`.
        Stops at the first hash no slot can be made for; (hash, host block) pairs for the caller to fill."""
        held: list[tuple[bytes, int]] = []
        for block_hash in hashes:
            if block_hash in self.host:
                continue
            placed = self.host.insert(block_hash)
            if placed is None:
                break
            self.host.held.add(block_hash)
            held.append((block_hash, placed[0]))
        return held

    def release_imports(self, filled: Iterable[bytes], failed: Iterable[bytes]) -> None:
        """Held host blocks filled (found from now on) or not (dropped)."""
        for block_hash in filled:
            self.host.held.discard(block_hash)
        for block_hash in failed:
            self.host.held.discard(block_hash)
            self.host.remove(block_hash)
            self.host.counters.writes -= 1

    def lost(self, hashes: Iterable[bytes]) -> None:
        """Disk blocks the runner could not write or read: no longer on disk, nor (if read into) in host."""
        for block_hash in hashes:
            if block_hash in self.disk:
                self.disk.remove(block_hash)
                self.disk.counters.lost += 1

    def failed_reads(self, hashes: Iterable[bytes]) -> None:
        """Disk reads that failed: the host blocks they were read into hold nothing."""
        hashes = list(hashes)
        for block_hash in hashes:
            self.host.remove(block_hash)
            self.host.counters.writes -= 1
        self.lost(hashes)

    def take_copies(self) -> TierCopies:
        """The copies planned since the last call, for the plan; nothing is busy after it."""
        copies, self.copies = self.copies, TierCopies()
        self._being_read.clear()
        self.host.step_done()
        self.disk.step_done()
        return copies
