"""Paged attention, plugged into transformers' attention interface.

The runner packs a step into one `[1, total_tokens]` forward: single-token sequences (decodes)
first, then prefill chunks. Per layer the new K/V are written into the block pool, and each
sequence's whole context is read back through its block table.

In a compiled forward (gpu/compiled.py) the layer's attention is two parts:
- `fairlane::write_and_prefill`, a registered op (`torch.library`): the pool write and the prefill
  chunks, whose per-chunk Python must neither break the graph nor be traced into per-sequence code.
  The graph sees one opaque call with tensor inputs; the step's layout reaches it as tensors passed
  explicitly, never through a global.
- the decodes, traced: inductor fuses each decode's gathers from the pool into the two reductions
  of its attention. In the op, they cost 0.15-0.23 ms a layer at one decode; traced, the whole
  SmolLM2 step measured a fifth faster.
Run eagerly, the same Python runs directly: the dispatcher would only add time.

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
    # [num_decodes] each decode's context length, its new token included: where a sliding window starts
    decode_lengths: torch.Tensor
    # [decode rows, block_size, head_dim] gather buffers shared by all layers of the step, in the dtype
    # attention computes in: allocating them per layer costs more than the math
    decode_keys: torch.Tensor
    decode_values: torch.Tensor
    # The same rows in the pool's dtype where it is narrower (else empty): the gather lands here and is
    # widened into the buffers above. Widening into a buffer made once per step took 0.5 ms a layer for
    # 8 decodes of 1,552 tokens where `.to()`'s fresh tensor took 2.1 (bfloat16, eager, 2 AVX2 cores).
    decode_staging: torch.Tensor
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

    def varying_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Each tensor with the dimensions whose size changes from step to step (the pool's block count
        with the pool's size); the others (heads, block size, head dim) are the model's and stay fixed."""
        return [(getattr(self, f.name), _VARYING_DIMS.get(f.name, (0,))) for f in fields(self)]


_VARYING_DIMS = {"kv_pool": (2,), "decode_bias": (0, 3)}


class UnsupportedAttention(ValueError):
    """The model's attention asks for something the paged attention does not compute: refused at load, never
    dropped."""


@dataclass(slots=True)
class LayerAttention:
    """What one layer's attention computes beyond softmax(q k^T * scaling) v, as transformers' model code
    passes it: a sliding window (keys more than `window - 1` positions back are hidden, transformers'
    `kv_idx > q_idx - window`), a softcap on the scaled logits (`tanh(s / cap) * cap`, Gemma 2), and attention
    sinks (one learned logit per head that joins every softmax's denominator, gpt-oss)."""

    scaling: float
    window: Any = None  # int or None; symbolic in a regionally compiled layer
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads]

    @property
    def is_plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        parts = [f"window {self.window}"] if self.window is not None else []
        parts += [f"softcap {self.softcap:g}"] if self.softcap is not None else []
        parts += ["sinks"] if self.sinks is not None else []
        return ", ".join(parts) or "full"


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """A `[blocks, kv_heads, block_size, dim]` pool as `[blocks * kv_heads, block_size, dim]` rows."""
    return pool.view(-1, *pool.shape[2:])


def _gather(pool: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    if out.dtype == pool.dtype:
        return torch.index_select(_rows(pool), 0, rows, out=out)
    return out.copy_(torch.index_select(_rows(pool), 0, rows, out=staging))


def _logits(raw: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """Raw q.k products -> the float32 logits softmax takes, scaled and softcapped as the model says."""
    scores = raw.float() * layer.scaling
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    return scores


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension; each sink (broadcast as scores[..., :1]) adds exp(sink) to the
    denominator, as the extra column gpt-oss's own attention concatenates and drops."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    # By hand, not logsumexp: traced, its decomposition guards on the (unbacked) number of keys being 0.
    sinks = sinks.float()
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    weights = torch.exp(scores - peak)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sinks - peak))


def _grouped_sinks(layer: LayerAttention, kv_heads: int) -> torch.Tensor | None:
    """[kv_heads, group, 1]: query heads grouped by the KV head they share (transformers' repeat_kv order)."""
    return None if layer.sinks is None else layer.sinks.view(kv_heads, -1, 1)


def _outside_window(lengths: torch.Tensor, num_keys: Any, window: Any) -> torch.Tensor:
    """[n, 1, 1, keys] True where a key fell out of the window of the query at position `lengths - 1`."""
    keys = torch.arange(num_keys, device=lengths.device)
    start: torch.Tensor = lengths - window
    return (keys[None, :] < start[:, None])[:, None, None, :]


def _decode_logits(raw: torch.Tensor, decode_bias: torch.Tensor, decode_lengths: torch.Tensor,
                   layer: LayerAttention) -> torch.Tensor:
    scores = _logits(raw, layer) + decode_bias
    if layer.window is not None:
        scores = scores.masked_fill(_outside_window(decode_lengths, decode_bias.shape[-1], layer.window),
                                    float("-inf"))
    return scores


def _decode_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PagedMetadata,
                      layer: LayerAttention) -> torch.Tensor:
    """The step's decodes, each over its padded context, run eagerly: the gathers land in the step's
    shared buffers and two batched matmuls do the math."""
    n, ctx = meta.decode_bias.shape[0], meta.decode_bias.shape[-1]
    kv_heads, dim = k_pool.shape[1], k_pool.shape[3]
    keys = _gather(k_pool, meta.decode_rows, meta.decode_keys, meta.decode_staging).view(n, kv_heads, ctx, dim)
    values = _gather(v_pool, meta.decode_rows, meta.decode_values, meta.decode_staging).view(n, kv_heads, ctx, dim)
    # Query heads grouped by the KV head they share (transformers' repeat_kv order): [n, kv_heads, group, dim]
    q = query[0, :, :n].transpose(0, 1).reshape(n, kv_heads, -1, dim)
    scores = _decode_logits(torch.matmul(q, keys.transpose(-1, -2)), meta.decode_bias, meta.decode_lengths, layer)
    probs = _softmax(scores, _grouped_sinks(layer, kv_heads)).to(values.dtype)
    return torch.matmul(probs, values).view(n, -1, dim)  # [n, heads, dim]


def _traced_decode_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             meta: PagedMetadata, layer: LayerAttention) -> torch.Tensor:
    """`_decode_attention` as products and sums, for inductor: the gathers fuse into two reductions that
    read each key and value once, with no intermediate copy of the context. (As matmuls, inductor's
    batched-GEMM lowering fails on the unbacked sizes: it guards on them.) Every view names its sizes,
    never -1: inferring one would divide by a count that may be 0 (a step without decodes)."""
    n, ctx = meta.decode_bias.shape[0], meta.decode_bias.shape[-1]
    heads, kv_heads, dim = query.shape[1], k_pool.shape[1], k_pool.shape[3]
    # A narrower pool is widened as it is read, inside the fused reductions: no widened copy is written.
    keys = _rows(k_pool)[meta.decode_rows].view(n, kv_heads, 1, ctx, dim).to(query.dtype)
    values = _rows(v_pool)[meta.decode_rows].view(n, kv_heads, 1, ctx, dim).to(query.dtype)
    q = query[0, :, :n].transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, 1, dim)
    scores = _decode_logits((q * keys).sum(-1), meta.decode_bias, meta.decode_lengths, layer)
    sinks = None if layer.sinks is None else layer.sinks.view(kv_heads, heads // kv_heads, 1)
    probs = _softmax(scores, sinks).to(values.dtype).unsqueeze(-1)  # [n, kv_heads, group, ctx, 1]
    return (probs * values).sum(-2).view(n, heads, dim)


def _visible_keys(context_len: int, num_queries: int, window: Any, device: torch.device) -> torch.Tensor:
    """[queries, keys] causal from the bottom right (query i sits at position context_len - num_queries + i),
    within the window where there is one."""
    positions = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    keys = torch.arange(context_len, device=device)[None, :]
    visible = keys <= positions
    return visible if window is None else visible & (keys > positions - window)


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                     layer: LayerAttention) -> torch.Tensor:
    """q [1, heads, queries, dim], keys and values [1, kv_heads, keys, dim] -> [1, heads, queries, dim].
    SDPA (its flash kernel on the CPU, which never holds every score) unless the logits need a softcap or
    sinks, which SDPA has no place for: then the scores are written out once, in float32."""
    if layer.softcap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=layer.scaling,
                                              is_causal=visible is None, enable_gqa=True)
    heads, num_queries, dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    if visible is None:
        visible = _visible_keys(num_keys, num_queries, None, q.device)
    grouped = q[0].reshape(kv_heads, heads // kv_heads, num_queries, dim)
    scores = _logits(torch.matmul(grouped, keys[0].unsqueeze(1).transpose(-1, -2)), layer)
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = _grouped_sinks(layer, kv_heads)
    probs = _softmax(scores, None if sinks is None else sinks.unsqueeze(-1)).to(values.dtype)
    return torch.matmul(probs, values[0].unsqueeze(1)).reshape(1, heads, num_queries, dim)


def _prefill_attention(chunk: list[int], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_pool: torch.Tensor, v_pool: torch.Tensor, prefill_rows: torch.Tensor,
                       layer: LayerAttention) -> torch.Tensor:
    query_start, num_queries, context_len, rows_start = chunk
    span = slice(query_start, query_start + num_queries)
    q = query[:, :, span]
    if rows_start == FRESH_PROMPT:  # the chunk itself is all the context
        keys, values = key[:, :, span], value[:, :, span]
    else:
        kv_heads, block_size, dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
        num_rows = kv_heads * -(-context_len // block_size)
        rows = prefill_rows[rows_start: rows_start + num_rows]
        keys = _rows(k_pool).index_select(0, rows).view(1, kv_heads, -1, dim)[:, :, :context_len].to(q.dtype)
        values = _rows(v_pool).index_select(0, rows).view(1, kv_heads, -1, dim)[:, :, :context_len].to(q.dtype)
    # A fresh prompt without a window is plainly causal (no mask to build); any other chunk is masked.
    plainly_causal = rows_start == FRESH_PROMPT and (layer.window is None or layer.window >= num_queries)
    visible = None if plainly_causal else _visible_keys(context_len, num_queries, layer.window, q.device)
    return _chunk_attention(q, keys, values, visible, layer)[0].transpose(0, 1)  # [num_queries, heads, dim]


def _write(layer_pool: torch.Tensor, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """key and value [kv_heads, tokens, dim], written head-major to the pool rows of their tokens, in the
    pool's dtype, by one copy for both: a decode-only step is all per-call overhead (a dozen small calls
    made this 65 us a layer, run once per layer per step)."""
    dim = layer_pool.shape[-1]
    new = torch.stack([key, value]).to(layer_pool.dtype).view(2, -1, dim)
    layer_pool.view(2, -1, dim).index_copy_(1, rows, new)


def _chunk_rows(query: torch.Tensor, num_decodes: Any) -> torch.Tensor:
    """The output of the prefill chunks' attention: one row per token after the decodes."""
    return query.new_empty(query.shape[2] - num_decodes, query.shape[1], query.shape[3])


def write_and_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                      write_rows: torch.Tensor, num_decodes: int, prefill_layout: torch.Tensor,
                      prefill_rows: torch.Tensor, scaling: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V of one layer into the pool, then attend the step's prefill chunks, each over
    its own context -> [tokens - num_decodes, heads, dim]."""
    layer_pool = kv_pool[layer]
    _write(layer_pool, write_rows, key[0], value[0])
    out = _chunk_rows(query, num_decodes)
    if not prefill_layout.shape[0]:  # a decode-only step: no list to make, in each layer
        return out
    k_pool, v_pool = layer_pool[0], layer_pool[1]
    features = LayerAttention(scaling, window, softcap, sinks)
    for chunk in prefill_layout.tolist():
        span = slice(chunk[QUERY_START] - num_decodes, chunk[QUERY_START] - num_decodes + chunk[NUM_QUERIES])
        out[span] = _prefill_attention(chunk, query, key, value, k_pool, v_pool, prefill_rows, features)
    return out


_OP_SCHEMA = ("write_and_prefill(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_pool, SymInt layer, "
              "Tensor write_rows, SymInt num_decodes, Tensor prefill_layout, Tensor prefill_rows, float scaling, "
              "SymInt? window, float? softcap, Tensor? sinks) -> Tensor")


def _define_op() -> Any:
    """`fairlane::write_and_prefill`, registered through `torch.library.Library` rather than
    `custom_op`: called once per layer in every step, even one without a chunk, the lighter dispatch
    measured 9 against 35 us a call. The pool write stays inside it: written by traced code, the
    pool (a graph input, mutated through a view) was copied whole at each write."""
    library = torch.library.Library("fairlane", "DEF")  # type: ignore[no-untyped-call]
    library.define(_OP_SCHEMA)  # type: ignore[no-untyped-call]
    library.impl("write_and_prefill", write_and_prefill, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    def shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
              write_rows: torch.Tensor, num_decodes: Any, *args: Any) -> torch.Tensor:
        return _chunk_rows(query, num_decodes)

    torch.library.register_fake("fairlane::write_and_prefill", shape, lib=library)
    return library


_LIBRARY = _define_op()  # kept alive: the op lives as long as its library object


def attend_paged(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: PagedMetadata, layer: int,
                 features: LayerAttention) -> torch.Tensor:
    """Write this step's K/V of one layer into the pool, then attend over each sequence's paged context.
    query [1, heads, tokens, dim], key and value [1, kv_heads, tokens, dim] -> [tokens, heads, dim].
    Traced, the write and the prefill chunks are one opaque op and the decodes inductor's to fuse."""
    num_decodes = meta.decode_bias.shape[0]
    layer_pool = meta.kv_pool.select(0, layer)  # select: a symbolic layer index stays symbolic
    k_pool, v_pool = layer_pool[0], layer_pool[1]
    chunk_args = (meta.write_rows, num_decodes, meta.prefill_layout, meta.prefill_rows, features.scaling,
                  features.window, features.softcap, features.sinks)
    if torch.compiler.is_compiling():
        chunks = torch.ops.fairlane.write_and_prefill(query, key, value, meta.kv_pool, layer, *chunk_args)
        decodes = _traced_decode_attention(query, k_pool, v_pool, meta, features)
        return torch.cat([decodes, chunks])
    chunks = write_and_prefill(query, key, value, meta.kv_pool, layer, *chunk_args)
    if not num_decodes:
        return chunks
    decodes = _decode_attention(query, k_pool, v_pool, meta, features)
    return decodes if not meta.prefill_layout.shape[0] else torch.cat([decodes, chunks])


# Keywords transformers' model code passes that change nothing here: the positions are the step's own (the
# rotary embedding has used them), the paged pool is the only cache, and no router logits reach attention.
IGNORED_KEYWORDS = frozenset({"position_ids", "use_cache", "output_router_logits", "cache_position",
                              "past_key_values", "position_embeddings"})


def layer_attention(module: torch.nn.Module, query: torch.Tensor, scaling: float | None, dropout: float,
                    sliding_window: Any, softcap: float | None, s_aux: torch.Tensor | None,
                    kwargs: dict[str, Any]) -> LayerAttention:
    """The layer's features from transformers' keywords; UnsupportedAttention for one this attention does not
    compute, naming the layer and the keyword."""
    layer = getattr(module, "layer_idx", "?")
    unknown = sorted(name for name, value in kwargs.items() if name not in IGNORED_KEYWORDS and value is not None)
    if kwargs.get("is_causal") is False:
        unknown = [name for name in unknown if name != "is_causal"] + ["is_causal=False (bidirectional)"]
    elif "is_causal" in unknown:
        unknown.remove("is_causal")
    if dropout:
        unknown.append(f"dropout={dropout}")
    if unknown:
        raise UnsupportedAttention(f"{type(module).__name__} of layer {layer} passes {', '.join(unknown)}, "
                                   f"which the paged attention does not compute")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return LayerAttention(scale, sliding_window, softcap, s_aux)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    attention_census: dict[int, tuple[LayerAttention, torch.Size]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' side of the op: one call per layer, the layer's index picking its pool. The mask
    transformers built is not read: each sequence's causal span and window come from the step's layout.
    `attention_census` (the runner's load-time probe) collects each layer's features and K shape."""
    if paged_metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs paged_metadata; run the model through the runner")
    features = layer_attention(module, query, scaling, dropout, sliding_window, softcap, s_aux, kwargs)
    if attention_census is not None:
        attention_census[int(module.layer_idx)] = (features, key.shape)  # type: ignore[arg-type]
    # The index as the module holds it, not int() of it: a regionally compiled layer (gpu/compiled.py) takes
    # it as a symbolic input, and int() would specialize the graph to one layer.
    out = attend_paged(query, key, value, paged_metadata, module.layer_idx, features)  # type: ignore[arg-type]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
