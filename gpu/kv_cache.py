"""Paged KV memory: a device pool and a CPU swap pool, both `[layers, 2, blocks, kv_heads, block_size, head_dim]`.

One tensor per pool, so a swap of many blocks across all layers is a single indexed copy.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


def zeroed_pool(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """A zeroed pool. In host memory (a CPU device, an unpinned swap pool) it is an anonymous mapping,
    whose pages the kernel hands out zeroed on first touch: `torch.zeros` touched all of them at
    start-up, 18 s for SmolLM2's 5.8 GiB float32 pool on a 2-vCPU VM, where now each block is paid for
    when first used. Zeroed, never `torch.empty`: attention multiplies the masked padding by a zero
    probability, and a stale NaN or infinity there would still poison the sum."""
    if device.type != "cpu" or pinned:
        return torch.zeros(*dims, dtype=dtype, device=device, pin_memory=pinned)
    size = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(*dims, dtype=dtype)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the buffer it was made from, and with it the mapping, as long as it lives.
    return torch.frombuffer(mapping, dtype=dtype).view(dims)


class PagedKVCache:
    """Owns the block pools. Which block holds what is decided elsewhere; this only stores and copies."""

    def __init__(self, shape: KVShape, num_device_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        if num_device_blocks < 1:
            raise ValueError("the KV budget is smaller than one block; raise kv_cache_bytes")
        self.shape = shape
        self.device = device
        dims = (shape.num_layers, 2)
        tail = (shape.num_kv_heads, shape.block_size, shape.head_dim)  # head-major blocks: see gpu.attention
        self.device_pool = zeroed_pool((*dims, num_device_blocks, *tail), shape.dtype, device)
        self.cpu_pool = zeroed_pool((*dims, num_cpu_blocks, *tail), shape.dtype, torch.device("cpu"),
                                    pinned=device.type == "cuda")
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as `[num_blocks, kv_heads, block_size, head_dim]` views."""
        return self.device_pool[layer, 0], self.device_pool[layer, 1]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks, all layers at once. pairs: (device block, cpu block)."""
        if not pairs:
            return
        device_ids = torch.tensor([d for d, _ in pairs], device=self.device)
        cpu_ids = torch.tensor([c for _, c in pairs])
        moved = self.device_pool.index_select(2, device_ids).to("cpu", non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.cpu_pool.index_copy_(2, cpu_ids, moved)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks. pairs: (cpu block, device block)."""
        if not pairs:
            return
        cpu_ids = torch.tensor([c for c, _ in pairs])
        device_ids = torch.tensor([d for _, d in pairs], device=self.device)
        # Gathered into pinned memory on CUDA, so the copy up is one asynchronous DMA; from a pageable
        # gather it would be staged through a bounce buffer, synchronously. (torch's pinned allocator
        # caches the staging buffer and keeps it until the copy using it is done.)
        staging_shape = (*self.cpu_pool.shape[:2], len(pairs), *self.cpu_pool.shape[3:])
        staging = torch.empty(staging_shape, dtype=self.cpu_pool.dtype, pin_memory=self.device.type == "cuda")
        torch.index_select(self.cpu_pool, 2, cpu_ids, out=staging)
        self.device_pool.index_copy_(2, device_ids, staging.to(self.device, non_blocking=True))
