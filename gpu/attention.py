"""Paged attention, plugged into transformers' attention interface.

The runner packs a step into one `[1, total_tokens]` forward: single-token sequences (decodes)
first, then prefill chunks. Per layer this function writes the new K/V into the block pool and reads
each sequence's whole context back through its block table.

The pool keeps each block head-major (`[kv_heads, block_size, head_dim]`), and a context is read as
one row of `block_size x head_dim` per (block, head). The rows land already in the
`[kv_heads, context, head_dim]` order attention multiplies by, so nothing is transposed or copied a
second time: at 64 decodes this is about a fifth cheaper than token-major blocks and SDPA.
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
    # [kv_heads * blocks] the (block, head) rows holding the whole context, head-major; None when the
    # chunk is the whole context
    context_rows: torch.Tensor | None
    mask: torch.Tensor | None  # [num_queries, context_len] bool; None for a plain causal chunk


@dataclass(slots=True)
class PagedMetadata:
    """One step's layout, built once by the runner and read by every layer."""

    cache: PagedKVCache
    # [kv_heads * total_tokens] where each new token's K/V row goes for each head (head-major), as an
    # index into the pool seen as [blocks * kv_heads * block_size, head_dim]
    write_rows: torch.Tensor
    num_decodes: int  # the first num_decodes tokens are single-token sequences
    # [num_decodes * kv_heads * blocks] each decode's context rows, padded to the longest with block 0
    decode_rows: torch.Tensor | None = None
    # [num_decodes, 1, 1, max_context] 0 where a key is visible, -inf where it is padding
    decode_bias: torch.Tensor | None = None
    max_decode_context: int = 0  # whole blocks: a multiple of the block size
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Gather buffers shared by all layers of the step: allocating per layer costs more than the math.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, num_rows: int, rows: torch.Tensor) -> torch.Tensor:
        """A `[num_rows, block_size, head_dim]` buffer for rows gathered out of a pool."""
        buf = self.workspace.get(name)
        if buf is None or buf.shape[0] != num_rows:
            buf = torch.empty((num_rows, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            self.workspace[name] = buf
        return buf


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """A `[blocks, kv_heads, block_size, dim]` pool as `[blocks * kv_heads, block_size, dim]` rows."""
    return pool.view(-1, *pool.shape[2:])


def _decode_attention(meta: PagedMetadata, query: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, scaling: float) -> torch.Tensor:
    n, ctx = meta.num_decodes, meta.max_decode_context
    assert meta.decode_rows is not None and meta.decode_bias is not None
    kv_heads, dim = k_pool.shape[1], k_pool.shape[3]
    rows = meta.decode_rows.shape[0]
    keys = torch.index_select(_rows(k_pool), 0, meta.decode_rows, out=meta.buffer("decode_k", rows, _rows(k_pool)))
    values = torch.index_select(_rows(v_pool), 0, meta.decode_rows,
                                out=meta.buffer("decode_v", rows, _rows(v_pool)))
    keys, values = keys.view(n, kv_heads, ctx, dim), values.view(n, kv_heads, ctx, dim)
    # Query heads grouped by the KV head they share (transformers' repeat_kv order): [n, kv_heads, group, dim]
    q = query[0, :, :n].transpose(0, 1).reshape(n, kv_heads, -1, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling + meta.decode_bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(n, -1, dim)  # [n, heads, dim]


def _prefill_attention(meta: PagedMetadata, chunk: PrefillChunk, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    span = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
    q = query[:, :, span]
    if chunk.context_rows is None:  # a fresh prompt: the chunk itself is all the context
        keys, values = key[:, :, span], value[:, :, span]
    else:
        rows, kv_heads = chunk.context_rows.shape[0], k_pool.shape[1]
        keys = torch.index_select(_rows(k_pool), 0, chunk.context_rows,
                                  out=meta.buffer(f"prefill_k{rows}", rows, _rows(k_pool)))
        values = torch.index_select(_rows(v_pool), 0, chunk.context_rows,
                                    out=meta.buffer(f"prefill_v{rows}", rows, _rows(v_pool)))
        keys = keys.view(1, kv_heads, -1, k_pool.shape[3])[:, :, : chunk.context_len]
        values = values.view(1, kv_heads, -1, v_pool.shape[3])[:, :, : chunk.context_len]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=chunk.mask, scale=scaling,
                                         is_causal=chunk.mask is None, enable_gqa=True)
    return out[0].transpose(0, 1)  # [num_queries, heads, dim]


def _write(pool: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    """new: [kv_heads, tokens, dim], written head-major to the pool rows of its tokens."""
    pool.view(-1, pool.shape[3]).index_copy_(0, rows, new.reshape(-1, pool.shape[3]))


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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k_pool, v_pool = meta.cache.layer_blocks(int(module.layer_idx))  # type: ignore[arg-type]
    _write(k_pool, meta.write_rows, key[0])
    _write(v_pool, meta.write_rows, value[0])
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, dim]
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(meta, query, k_pool, v_pool, scale)
    for chunk in meta.prefills:
        span = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
        out[span] = _prefill_attention(meta, chunk, query, key, value, k_pool, v_pool, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
