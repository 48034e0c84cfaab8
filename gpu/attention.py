"""Paged attention, plugged into transformers' attention interface.

The runner packs a step into one `[1, total_tokens]` forward: single-token sequences (decodes)
first, then prefill chunks. Per layer this function writes the new K/V into the block pool by slot
and reads each sequence's whole context back through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from gpu.kv_cache import PagedKVCache

ATTENTION_NAME = "fairlane_paged"


@dataclass(slots=True)
class PrefillChunk:
    """A multi-token chunk: queries at [query_start, query_start + num_queries) of the packed batch."""

    query_start: int
    num_queries: int
    context_len: int  # keys visible to the last query, cached ones included
    context_blocks: torch.Tensor | None  # blocks holding the whole context; None when the chunk is the context
    mask: torch.Tensor | None  # [num_queries, context_len] bool; None for a plain causal chunk


@dataclass(slots=True)
class PagedMetadata:
    """One step's layout, built once by the runner and read by every layer."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [total_tokens] where each new token's K/V goes
    num_decodes: int  # the first num_decodes tokens are single-token sequences
    # [num_decodes * blocks] the blocks of each decode's context, padded to the longest with block 0
    decode_blocks: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] True where a key is visible
    max_decode_context: int = 0  # whole blocks: a multiple of the block size
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Gather buffers shared by all layers of the step: allocating per layer costs more than the math.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, rows: int, pool: torch.Tensor) -> torch.Tensor:
        """A `[rows, kv_heads, dim]` buffer for keys or values gathered out of a block pool."""
        buf = self.workspace.get(name)
        if buf is None or buf.shape[0] != rows:
            buf = torch.empty((rows, *pool.shape[2:]), dtype=pool.dtype, device=pool.device)
            self.workspace[name] = buf
        return buf


def _gather(pool: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Whole blocks out of a `[num_blocks, block_size, kv_heads, dim]` pool, as `[rows, kv_heads, dim]`:
    one contiguous copy per block instead of one per token."""
    torch.index_select(pool, 0, blocks, out=out.view(-1, *pool.shape[1:]))
    return out


def _decode_attention(meta: PagedMetadata, query: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, scaling: float | None) -> torch.Tensor:
    n, ctx = meta.num_decodes, meta.max_decode_context
    assert meta.decode_blocks is not None
    keys = _gather(k_pool, meta.decode_blocks, meta.buffer("decode_k", n * ctx, k_pool))
    values = _gather(v_pool, meta.decode_blocks, meta.buffer("decode_v", n * ctx, v_pool))
    keys = keys.view(n, ctx, *k_pool.shape[2:]).transpose(1, 2)  # [n, kv_heads, ctx, dim]
    values = values.view(n, ctx, *v_pool.shape[2:]).transpose(1, 2)
    q = query[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, dim]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask, scale=scaling,
                                         enable_gqa=True)
    return out[:, :, 0]  # [n, heads, dim]


def _prefill_attention(meta: PagedMetadata, chunk: PrefillChunk, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:
    span = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
    q = query[:, :, span]
    if chunk.context_blocks is None:  # a fresh prompt: the chunk itself is all the context
        keys, values = key[:, :, span], value[:, :, span]
    else:
        rows = chunk.context_blocks.shape[0] * k_pool.shape[1]
        keys = _gather(k_pool, chunk.context_blocks, meta.buffer(f"prefill_k{rows}", rows, k_pool))
        values = _gather(v_pool, chunk.context_blocks, meta.buffer(f"prefill_v{rows}", rows, v_pool))
        keys = keys[: chunk.context_len].transpose(0, 1).unsqueeze(0)
        values = values[: chunk.context_len].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=chunk.mask, scale=scaling,
                                         is_causal=chunk.mask is None, enable_gqa=True)
    return out[0].transpose(0, 1)  # [num_queries, heads, dim]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write this step's K/V into the pool, then attend over each sequence's paged context."""
    if paged_metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs paged_metadata; run the model through the runner")
    meta = paged_metadata
    k_pool, v_pool = meta.cache.layer_blocks(int(module.layer_idx))  # type: ignore[arg-type]
    slot_shape = (-1, *k_pool.shape[2:])
    k_pool.view(slot_shape).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_pool.view(slot_shape).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, dim]
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(meta, query, k_pool, v_pool, scaling)
    for chunk in meta.prefills:
        span = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
        out[span] = _prefill_attention(meta, chunk, query, key, value, k_pool, v_pool, scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
