"""Which packed layers keep an int8 copy, and its smoothing: one pass of the float model over a text.

An int8 copy (gpu/quantization.py) quantizes a step's activations to 8 bits a row at a time, so a few
input channels far larger than the rest take a row's whole range and leave the others a handful of
levels. SmoothQuant (Xiao et al., 2023) moves that range into the weights: input channel j is divided
by s_j = sqrt(max|x_j| / max|W_j|) and the weight's column j multiplied by it, which leaves the product
as it was.

The pass runs the float model, before its layers are packed, over `CALIBRATION_TOKENS` tokens of a
fixed English text (the docstrings of a few standard-library modules; `fairlane bench quality` measures
perplexity on another text). Each linear layer's inputs give its s, and the relative error of its
smoothed int8 product against the float one over those same inputs, a token at a time. A layer past
`INT8_MAX_ERROR` keeps no int8 copy, and so does the LM head, whose error lands on the logits as it
is. Such a layer keeps the packed kernel, or, where the plan measured a float copy faster from some row
count on (`KernelPlan.fallback`, gpu/linear_kernels.py), takes that copy from there. (Taken from the int8
copies' row count, a bfloat16 copy in those layers read the perplexity text a little closer, 12.303, but
made compiled steps of 12-32 decodes 14-24% slower: 81.7 against 65.9 ms at 32; from its own row count
it costs those steps nothing.) SmolLM2's perplexity over its text (`fairlane bench quality`, Zen 4
EPYC), float32 12.320, int4 on the packed kernels alone 12.341, with int8 copies in:

| int8 copies in | unsmoothed | smoothed |
|---|---|---|
| every layer | 13.039 | 12.508 |
| every layer but the MLPs' down projections and the head (packed) | | 12.351 |
| the layers within 2% (176 of 210), the others packed | | 12.355 |

(down projections err 2.1-2.8% a token, the other layers 0.6-2.2%).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import subprocess
import unittest
from typing import Any

import torch
from torch import nn

from gpu.quantization import (
    INT8_PRECISIONS,
    Int8Precision,
    Quantization,
    head_layer_name,
    int8_dynamic_linear,
    int8_per_row,
    layer_modes,
)
from gpu.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
INT8_MAX_ERROR = 0.02  # a layer's |int8 product - float product| / |float product| over the calibration text
ERROR_TOKEN_STRIDE = 4  # the error is measured on every 4th token: the float product is most of a start's pass


def calibration_text() -> str:
    """English prose and some code, present wherever Python is."""
    return "\n\n".join(module.__doc__ or "" for module in (argparse, subprocess, difflib, unittest, json))


def smoothing_factors(x: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s per input channel (the module's note, there with alpha 0.5) from a layer's inputs [rows, in] and
    weight [out, in]: max|x_j|^alpha / max|W_j|^(1 - alpha)."""
    x_range = x.abs().amax(dim=0).float().clamp(min=1e-5)
    weight_range = weight.abs().amax(dim=0).float().clamp(min=1e-5)
    return (x_range.pow(alpha) / weight_range.pow(1 - alpha)).clamp(min=1e-5)


def int8_error(x: torch.Tensor, weight: torch.Tensor, smoothing: torch.Tensor,
               precision: Int8Precision = INT8_PRECISIONS["int_mm"]) -> float:
    """The relative error of the smoothed int8 product against the float one, a token at a time, averaged:
    over all tokens at once, the few tokens with massive activations (a sequence's first) would hide the
    others' errors."""
    exact = x.float() @ weight.float().t()
    values, scales = int8_per_row(weight.float() * smoothing, precision.weight_levels)
    approximate = int8_dynamic_linear(x.float() / smoothing, values.t().contiguous(), scales,
                                      precision.activation_levels)
    per_token = (approximate - exact).norm(dim=-1) / exact.norm(dim=-1).clamp(min=1e-12)
    return float(per_token.mean())


@torch.inference_mode()
def calibrate_int8_copies(model: Any, mode: Quantization, tokenizer: Tokenizer, max_tokens: int = CALIBRATION_TOKENS,
                          precision: Int8Precision = INT8_PRECISIONS["int_mm"]) -> dict[str, torch.Tensor]:
    """The smoothing of every layer to be packed whose int8 copy keeps within INT8_MAX_ERROR at `precision`
    (`DenseCopy.int8_precision`), by module name; the model must still hold its float linear layers."""
    head = head_layer_name(model)
    names = [name for name in layer_modes(model, mode) if name != head]
    smoothing: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}

    def measure(name: str, layer: nn.Linear, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        factors = smoothing_factors(flat, layer.weight, precision.smoothing_alpha)
        errors[name] = int8_error(flat[::ERROR_TOKEN_STRIDE], layer.weight, factors, precision)
        if errors[name] <= INT8_MAX_ERROR:
            smoothing[name] = factors

    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda layer, args, name=name: measure(name, layer, args[0])) for name in names]
    try:
        device = next(model.parameters()).device
        token_ids = tokenizer.encode(calibration_text())[:max_tokens]
        model(input_ids=torch.tensor([token_ids], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    erring = sorted(set(names) - set(smoothing), key=names.index)
    logger.info("int8 copies: %d of %d layers within %.0f%% error over %d calibration tokens; the packed "
                "kernel in every step for the LM head and %d more: %s", len(smoothing), len(names),
                INT8_MAX_ERROR * 100, len(token_ids), len(erring),
                ", ".join(f"{name} ({errors[name]:.1%})" for name in erring[:4]))
    return smoothing
