"""Paged attention, plugged into transformers' attention interface as one registered custom op.

The runner packs a step into one `[1, total_tokens]` forward: single-token sequences (decodes)
first, then prefill chunks. Per layer `fairlane::paged_attention` writes the new K/V into the block
pool and reads each sequence's whole context back through its block table.

Why a custom op (`torch.library`): a compiled forward (gpu/compiled.py) sees it as one opaque call
with tensor inputs, so the per-chunk Python inside neither breaks the graph nor is traced into
per-sequence code, and the step's layout reaches it as tensors passed explicitly, never through a
global. Run eagerly, the op's Python body is called directly: the dispatcher would only add time.

The pool keeps each block head-major (`[kv_heads, block_size, head_dim]`), and a context is read as
one row of `block_size x head_dim` per (block, head). The rows land already in the
`[kv_heads, context, head_dim]` order attention multiplies by, so nothing is transposed or copied a
second time: at 64 decodes this is about a fifth cheaper than token-major blocks and SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "fairlane_paged"

# Columns of PagedMetadata.prefill_layout, one row per multi-token chunk.
QUERY_START, NUM_QUERIES, CONTEXT_LEN, ROWS_START = range(4)
FRESH_PROMPT = -1  # ROWS_START of a chunk that is its whole context: its keys are the chunk's own


@dataclass(slots=True)
class PagedMetadata:
    """One step's layout, built once by the runner and read by every layer. Only tensors: a compiled
    forward takes each field as a graph input and guards on none of their values."""

    # The device pool `[layers, 2, blocks, kv_heads, block_size, head_dim]`, written in place.
    kv_pool: torch.Tensor
    # [kv_heads * total_tokens] where each new token's K/V row goes for each head (head-major), as an
    # index into a layer's pool seen as [blocks * kv_heads * block_size, head_dim]
    write_rows: torch.Tensor
    # [num_decodes * kv_heads * blocks] each decode's context rows, padded to the longest with block 0;
    # the first num_decodes tokens of the step are the decodes
    decode_rows: torch.Tensor
    # [num_decodes, 1, 1, max_context] 0 where a key is visible, -inf where it is padding; max_context
    # is in whole blocks
    decode_bias: torch.Tensor
    # [decode rows, block_size, head_dim] gather buffers shared by all layers of the step: allocating
    # them per layer costs more than the math
    decode_keys: torch.Tensor
    decode_values: torch.Tensor
    # CPU int64 [chunks, 4]: query start, number of queries, context length (keys visible to the last
    # query, cached ones included), start of the chunk's rows in prefill_rows (FRESH_PROMPT: none)
    prefill_layout: torch.Tensor
    # the (block, head) rows holding each cached-context chunk's whole context, head-major, concatenated
    prefill_rows: torch.Tensor

    @property
    def num_decodes(self) -> int:
        return int(self.decode_bias.shape[0])

    @property
    def max_decode_context(self) -> int:
        return int(self.decode_bias.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """A `[blocks, kv_heads, block_size, dim]` pool as `[blocks * kv_heads, block_size, dim]` rows."""
    return pool.view(-1, *pool.shape[2:])


def _decode_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode_rows: torch.Tensor,
                      decode_bias: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    n, ctx = decode_bias.shape[0], decode_bias.shape[-1]
    kv_heads, dim = k_pool.shape[1], k_pool.shape[3]
    keys = torch.index_select(_rows(k_pool), 0, decode_rows, out=key_buffer).view(n, kv_heads, ctx, dim)
    values = torch.index_select(_rows(v_pool), 0, decode_rows, out=value_buffer).view(n, kv_heads, ctx, dim)
    # Query heads grouped by the KV head they share (transformers' repeat_kv order): [n, kv_heads, group, dim]
    q = query[0, :, :n].transpose(0, 1).reshape(n, kv_heads, -1, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling + decode_bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(n, -1, dim)  # [n, heads, dim]


def _prefill_attention(chunk: list[int], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_pool: torch.Tensor, v_pool: torch.Tensor, prefill_rows: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    query_start, num_queries, context_len, rows_start = chunk
    span = slice(query_start, query_start + num_queries)
    q, mask = query[:, :, span], None
    if rows_start == FRESH_PROMPT:  # the chunk itself is all the context: plainly causal
        keys, values = key[:, :, span], value[:, :, span]
    else:
        kv_heads, block_size, dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
        num_rows = kv_heads * -(-context_len // block_size)
        rows = prefill_rows[rows_start: rows_start + num_rows]
        keys = _rows(k_pool).index_select(0, rows).view(1, kv_heads, -1, dim)[:, :, :context_len]
        values = _rows(v_pool).index_select(0, rows).view(1, kv_heads, -1, dim)[:, :, :context_len]
        # Causal from the bottom right: query i sits at position context_len - num_queries + i.
        positions = torch.arange(context_len - num_queries, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling,
                                         is_causal=mask is None, enable_gqa=True)
    return out[0].transpose(0, 1)  # [num_queries, heads, dim]


def _write(pool: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    """new: [kv_heads, tokens, dim], written head-major to the pool rows of its tokens."""
    pool.view(-1, pool.shape[3]).index_copy_(0, rows, new.reshape(-1, pool.shape[3]))


def attend_paged(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                    write_rows: torch.Tensor, decode_rows: torch.Tensor, decode_bias: torch.Tensor,
                    decode_keys: torch.Tensor, decode_values: torch.Tensor, prefill_layout: torch.Tensor,
                    prefill_rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """Write this step's K/V of one layer into the pool, then attend over each sequence's paged context.
    query [1, heads, tokens, dim], key and value [1, kv_heads, tokens, dim] -> [tokens, heads, dim]."""
    k_pool, v_pool = kv_pool[layer, 0], kv_pool[layer, 1]
    _write(k_pool, write_rows, key[0])
    _write(v_pool, write_rows, value[0])
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    num_decodes = decode_bias.shape[0]
    if num_decodes:
        out[:num_decodes] = _decode_attention(query, k_pool, v_pool, decode_rows, decode_bias, decode_keys,
                                              decode_values, scaling)
    for chunk in prefill_layout.tolist():
        span = slice(chunk[QUERY_START], chunk[QUERY_START] + chunk[NUM_QUERIES])
        out[span] = _prefill_attention(chunk, query, key, value, k_pool, v_pool, prefill_rows, scaling)
    return out


paged_attention = torch.library.custom_op("fairlane::paged_attention", attend_paged,
                                          mutates_args=("kv_pool", "decode_keys", "decode_values"))


@paged_attention.register_fake
def _paged_attention_shape(query: torch.Tensor, *args: Any) -> torch.Tensor:
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


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
    """transformers' side of the op: one call per layer, the layer's index picking its pool."""
    if paged_metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs paged_metadata; run the model through the runner")
    meta = paged_metadata
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # Traced, the op stays one opaque node; eager, its body runs without the dispatcher's overhead.
    attend = paged_attention if torch.compiler.is_compiling() else attend_paged
    out = attend(query, key, value, meta.kv_pool, int(module.layer_idx),  # type: ignore[arg-type]
                 meta.write_rows, meta.decode_rows, meta.decode_bias, meta.decode_keys, meta.decode_values,
                 meta.prefill_layout, meta.prefill_rows, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
