"""Torch-free KV block accounting: which blocks are free, who holds what, and reference counts.

The allocator reports, the policy decides: methods answer None or False when there is no room;
what to do about it is the scheduler's call.
"""

from __future__ import annotations

from collections import deque

from scheduling.request import Request


class BlockPool:
    """A fixed set of block ids with reference counts (shared blocks come with prefix caching)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = [self._free.popleft() for _ in range(count)]
        for block in taken:
            self._ref_counts[block] = 1
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block with none left is free again."""
        for block in block_ids:
            if self._ref_counts[block] <= 0:
                raise AssertionError(f"block {block} freed more often than allocated")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)


class KVBlockManager:
    """Device and CPU block pools, and the mapping of requests to blocks."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)

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

    def free(self, request: Request) -> None:
        """Return the request's device and CPU blocks."""
        self.device.free(request.block_ids)
        self.cpu.free(request.cpu_block_ids)
        request.block_ids = []
        request.cpu_block_ids = []

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
