"""What a model asks of the paged attention, found at load: served, or refused with one line naming the
model, the feature and the layer. Nothing a model's code passes is dropped.

Two checks. The config's: layer kinds other than full and sliding attention (linear attention, Mamba,
chunked attention) and latent attention (MLA) are refused by name. Then a probe: one two-token step
through the eager forward over a scratch pool, in which every layer's attention reports the features
transformers passed it (gpu/attention.py refuses a keyword it does not compute) and its key shape, so a
layer that runs no attention, or whose KV shape differs from the pool's, is refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from contract.plan import SamplingParams, ScheduledSequence
from gpu.attention import LayerAttention, UnsupportedAttention
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.step_inputs import build_step_inputs

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def text_config_of(config: Any) -> Any:
    """The decoder's own config: a multimodal model nests it (`text_config`); transformers' accessor finds it."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_architecture(name: str, config: Any) -> None:
    """UnsupportedAttention for what the config alone shows the paged attention cannot serve."""
    text = text_config_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedAttention(f"{name}: encoder-decoder models are not served (decoder-only models only)")
    if getattr(text, "kv_lora_rank", None):
        raise UnsupportedAttention(f"{name}: multi-head latent attention (kv_lora_rank "
                                   f"{text.kv_lora_rank}) is not served: the pool keeps per-head keys and values")
    for index, kind in enumerate(getattr(text, "layer_types", None) or ()):
        if kind not in ATTENTION_LAYER_TYPES:
            raise UnsupportedAttention(f"{name}: layer {index} is '{kind}', not attention the paged cache can "
                                       f"hold (served: {', '.join(sorted(ATTENTION_LAYER_TYPES))})")


def probe_attention(name: str, model: Any, shape: KVShape, device: torch.device) -> list[LayerAttention]:
    """Each layer's attention features, from one eager two-token step over a scratch pool."""
    scratch = PagedKVCache(KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_size,
                                   shape.compute_dtype or shape.dtype), 2, 0, device)
    probe = ScheduledSequence("probe", [1, 1], 0, (0, 1)[: -(-2 // shape.block_size)], True, SamplingParams())
    step = build_step_inputs([probe], scratch)
    census: dict[int, tuple[LayerAttention, torch.Size]] = {}
    try:
        with torch.inference_mode():
            model(input_ids=step.input_ids, position_ids=step.positions, logits_to_keep=1, use_cache=False,
                  paged_metadata=step.metadata, attention_census=census)
    except UnsupportedAttention as exc:
        raise UnsupportedAttention(f"{name}: {exc}") from exc
    silent = [index for index in range(shape.num_layers) if index not in census]
    if silent:
        raise UnsupportedAttention(f"{name}: layers {silent} run no attention through the paged cache")
    for index, (_, key_shape) in sorted(census.items()):
        if (key_shape[1], key_shape[3]) != (shape.num_kv_heads, shape.head_dim):
            raise UnsupportedAttention(
                f"{name}: layer {index} keeps {key_shape[1]} KV heads of {key_shape[3]} where the pool holds "
                f"{shape.num_kv_heads} of {shape.head_dim}: per-layer KV shapes are not served")
    return [census[index][0] for index in range(shape.num_layers)]


def capability_line(name: str, config: Any, layers: Sequence[LayerAttention]) -> str:
    """One line for the start-up log: the architecture and the attention features its layers use."""
    kinds: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        kinds.setdefault(layer.describe(), []).append(index)
    described = "; ".join(f"{kind} ({_spans(indices)})" for kind, indices in kinds.items())
    text = text_config_of(config)
    return (f"{name}: {text.model_type}, {len(layers)} layers of paged attention: {described}; "
            f"context {getattr(text, 'max_position_embeddings', '?')} tokens")


def _spans(indices: list[int]) -> str:
    return f"layer {indices[0]}" if len(indices) == 1 else f"{len(indices)} layers"
