"""Paged KV memory: a device pool, a CPU swap pool and the prefix cache's host tier, each
`[layers, 2, blocks, kv_heads, block_size, head_dim]`.

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
    dtype: torch.dtype  # the pools'
    compute_dtype: torch.dtype | None = None  # what attention widens the pool's values to; None: the same

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


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 for a float32 model on a CPU, else the model's dtype. A decode reads its whole
    context from the pool, and at long contexts that is most of what it reads: on 2 AVX2 cores, 8
    compiled SmolLM2 decodes over 1,536 tokens took 143 ms from a bfloat16 pool against 216 ms from a
    float32 one (160 ms in float16), and one decode 38 against 45 ms; run eagerly (the steps that take
    dense copies, gpu/linear_kernels.py), 225 against 223 ms. Widening bfloat16 is a shift, which
    inductor fuses into the attention's reductions on any x86 CPU; the pool holds twice the
    tokens; `fairlane bench quality` puts its cost in perplexity at docs/benchmarks/quality.md."""
    if choice != "auto":
        return KV_CACHE_DTYPES[choice]
    if device.type == "cpu" and model_dtype == torch.float32:
        return torch.bfloat16
    return model_dtype


class PagedKVCache:
    """Owns the block pools. Which block holds what is decided elsewhere; this only stores and copies.

    Three pools: the device pool the forward reads, the swap pool of preempted requests, and the host
    tier of the prefix cache (scheduling/cache_tiers.py). The two host pools are pinned on CUDA."""

    def __init__(self, shape: KVShape, num_device_blocks: int, num_cpu_blocks: int, device: torch.device,
                 num_host_blocks: int = 0) -> None:
        if num_device_blocks < 1:
            raise ValueError("the KV budget is smaller than one block; raise kv_cache_bytes")
        self.shape = shape
        self.device = device
        self.device_pool = self._pool(num_device_blocks, device)
        self.cpu_pool = self._pool(num_cpu_blocks, torch.device("cpu"), pinned=device.type == "cuda")
        self.host_pool = self._pool(num_host_blocks, torch.device("cpu"), pinned=device.type == "cuda")
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.num_host_blocks = num_host_blocks

    def _pool(self, num_blocks: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
        shape = self.shape
        dims = (shape.num_layers, 2, num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
        return zeroed_pool(dims, shape.dtype, device, pinned)  # head-major blocks: see gpu.attention

    def device_block(self, block: int) -> torch.Tensor:
        """One device block, all layers: a `[layers, 2, kv_heads, block_size, head_dim]` view."""
        return self.device_pool[:, :, block]

    def host_block(self, block: int) -> torch.Tensor:
        """One block of the host tier, all layers: a `[layers, 2, kv_heads, block_size, head_dim]` view."""
        return self.host_pool[:, :, block]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to swap blocks, all layers at once. pairs: (device block, cpu block)."""
        self._copy_down(self.cpu_pool, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy swap blocks back to device blocks. pairs: (cpu block, device block)."""
        self._copy_up(self.cpu_pool, pairs)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to the host tier. pairs: (device block, host block)."""
        self._copy_down(self.host_pool, pairs)

    def onload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host-tier blocks to device blocks. pairs: (host block, device block)."""
        self._copy_up(self.host_pool, pairs)

    def _copy_down(self, host_pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        device_ids = torch.tensor([d for d, _ in pairs], device=self.device)
        host_ids = torch.tensor([c for _, c in pairs])
        moved = self.device_pool.index_select(2, device_ids).to("cpu", non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        host_pool.index_copy_(2, host_ids, moved)

    def _copy_up(self, host_pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        host_ids = torch.tensor([c for c, _ in pairs])
        device_ids = torch.tensor([d for _, d in pairs], device=self.device)
        # Gathered into pinned memory on CUDA, so the copy up is one asynchronous DMA; from a pageable
        # gather it would be staged through a bounce buffer, synchronously. (torch's pinned allocator
        # caches the staging buffer and keeps it until the copy using it is done.)
        staging_shape = (*host_pool.shape[:2], len(pairs), *host_pool.shape[3:])
        staging = torch.empty(staging_shape, dtype=host_pool.dtype, pin_memory=self.device.type == "cuda")
        torch.index_select(host_pool, 2, host_ids, out=staging)
        self.device_pool.index_copy_(2, device_ids, staging.to(self.device, non_blocking=True))
