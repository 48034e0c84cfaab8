"""Weight-only quantization of a model's linear layers, the LM head included, onto torch's packed kernels.

- int8: one symmetric scale per output row; `aten._weight_int8pack_mm`.
- int4: groups of 32 along the input, a scale and a minimum per group (the layout of GGUF's Q4_1, so a
  Q4_1 file's weights come back as the same integers); `aten._weight_int4pack_mm_for_cpu` on the
  CPU, `aten._weight_int4pack_mm` on CUDA. The LM head keeps 8 bits, as GGUF's 4-bit files keep
  their output matrix (Q8_0 or Q6_K): in 4 bits it alone cost SmolLM2 5.6% of perplexity, and with
  it in 8 bits int4 is float32's perplexity to 0.03% (`fairlane bench quality`).

Only the weights are stored in fewer bits, which is what decides a decode step's time (every
weight is read once per step). The kernels take bfloat16, float16 or float32 activations, but on
the CPU their float32 paths are not vectorized (on an AVX2 machine: 38 ms for the LM head in int4
against 3.4 ms in bfloat16, 13.5 ms unquantized), so a float32 model on the CPU hands them its
activations in bfloat16 and takes the result back in float32. A layer whose shape a kernel cannot
take keeps its float weight.

A packed layer may also keep a dense copy of the same quantized values (`DenseCopy`), multiplied
instead of the packed weight when a step has at least its `from_rows` rows: a prompt chunk or a large
batch computes more than it reads, and there the packed weight-only kernels, which dequantize their
weights again for every few rows, are the slower ones (measured per machine: gpu/linear_kernels.py).
A float copy holds the integers times their scales, so both kernels compute with the same weights. An
int8 copy holds them again in 8 bits, a scale per output row, and multiplies them with the step's
activations quantized to int8 a row at a time (`aten._int_mm`, VNNI's integer dot products on an x86
CPU): on a Zen 4 EPYC SmolLM2's step linears took 23 ms at 16 rows and 45 at 64 that way, against 33
and 121 ms on the packed kernels and 31 and 64 on bfloat16 copies. A compiled graph takes the copy
only where the step's token count is known to reach `from_rows`: the runner compiles a second graph
for such steps (gpu/compiled.py). The LM head multiplies only the rows a step keeps logits for (its
decodes, a prompt chunk's last token), which no graph knows, so it keeps a float copy of its own
(planned apart) and chooses when the step runs, inside a registered op (`rows_switched_int8`): on
that EPYC its int8 kernel took 12.6 ms at 16 rows, a third of the step, where a bfloat16 copy took 6.6.

Without VNNI, `aten._int_mm` on the CPU is a plain loop (an AVX2 EPYC: 641 ms for SmolLM2's step linears
at 8 rows), so an int8 copy may multiply on fbgemm's kernels instead (`DenseCopy.int8_gemm`, a candidate
of the plan under `--linear-kernels auto-fbgemm`, gpu/linear_kernels.py): fbgemm packs the copy once and
sums pairs of uint8 x int8 products with AVX2's `vpmaddubsw`. On a Zen 1 EPYC (AVX2, no VNNI), called in
a loop over SmolLM2's step linears, fbgemm took 23, 35, 41 and 67 ms at 1, 4, 8 and 16 rows, against
28, 43, 73 and 129 for the packed int4 kernels in the plan's timing.
Those pairs are summed in int16, which saturates past 32,767, so one side keeps 7 bits there: the
activations, as fbgemm's own `reduce_range` does (127 x 127 x 2 fits), with the smoothing moved further
into the weights (`Int8Precision`). The calibration measures each layer at the precision its GEMM has;
SmolLM2 (perplexity over 3,000 tokens of CPython's LICENSE, windows of 512: float32 12.302, int4 on the
packed kernels 12.313):

| fbgemm copies | SmoothQuant alpha | layers within 2% | perplexity |
|---|---|---|---|
| 7-bit weights, 8-bit activations | 0.6 | 130 of 210 | 12.450 |
| 8-bit weights, 7-bit activations | 0.5 | 53 | 12.300 |
| 8-bit weights, 7-bit activations | 0.8 | 148 | 12.276 |
| 8-bit weights, 7-bit activations | 0.9 | 148 | 12.460 |

A weight's rounding errs the same way for every token, an activation's does not: 7-bit weights within the
same per-token bound cost ten times the perplexity.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

logger = logging.getLogger(__name__)

Quantization = Literal["none", "int8", "int4"]
# "auto": the precision the weights ship in (a 4-bit GGUF serves in int4, an 8-bit one in int8,
# anything else unquantized); gpu/models.resolve_quantization decides.
QuantizationChoice = Literal["auto", "none", "int8", "int4"]
INT4_GROUP_SIZE = 32
INT4_ROW_MULTIPLE = 64  # output rows the packed int4 kernels tile by
Int8Gemm = Literal["int_mm", "fbgemm"]  # what an int8 copy multiplies with (the module's note)
INT8_LEVELS = 127  # a symmetric int8 value's largest magnitude


@dataclass(frozen=True, slots=True)
class Int8Precision:
    """An int8 copy's precision on its GEMM: the largest magnitude of its weights' and its activations'
    values, and SmoothQuant's alpha (input channel j divided by max|x_j|^alpha / max|W_j|^(1-alpha))."""

    weight_levels: int = INT8_LEVELS
    activation_levels: int = INT8_LEVELS
    smoothing_alpha: float = 0.5


# fbgemm: 7-bit activations, so a pair of uint8 x int8 products stays within int16 (the module's note)
FBGEMM_PRECISION = Int8Precision(activation_levels=63, smoothing_alpha=0.8)
INT8_PRECISIONS: dict[Int8Gemm, Int8Precision] = {"int_mm": Int8Precision(), "fbgemm": FBGEMM_PRECISION}
# Read on every fbgemm multiply, so kept as plain ints: the activations' -levels..levels are handed to
# fbgemm as uint8 1..2 x levels + 1.
_FBGEMM_LEVELS = FBGEMM_PRECISION.activation_levels
_FBGEMM_ZERO_POINT = _FBGEMM_LEVELS + 1


@dataclass(frozen=True, slots=True)
class DenseCopy:
    """A packed layer's values kept dense in `dtype` too, multiplied instead from `from_rows` rows on.
    torch.int8: 8-bit values with int8 activations (the module's note), only in the layers calibrated
    for them; the others keep the packed kernel at every row count."""

    dtype: torch.dtype
    from_rows: int
    int8_gemm: Int8Gemm = "int_mm"

    @property
    def int8_precision(self) -> Int8Precision:
        """An int8 copy's precision: what the calibration measures its error at."""
        return INT8_PRECISIONS[self.int8_gemm]


class PackedLinear(nn.Module):
    """What the packed layers share: the optional dense copy and the choice between it and the packed kernel."""

    dense_weight: torch.Tensor | None  # [out, in] in a float dtype; int8 on `_int_mm`: [in, out], as it takes it
    dense_scales: torch.Tensor | None  # an int8 copy's scale per output row on `_int_mm`, float32
    dense_input_scales: torch.Tensor | None  # an int8 copy's smoothing: what each input channel is multiplied by
    # An int8 copy on fbgemm: its values and scales, packed once (no `dense_weight` beside them).
    fbgemm_weight: FbgemmWeight | None = None
    bias: torch.Tensor | None
    # An LM head's rows are the logits a step keeps, which no compiled graph knows against `dense_from_rows`:
    # such a layer chooses between its copy and the packed kernel when the step runs (an int8 head only).
    switches_at_run_time: bool = False
    in_features: int
    out_features: int
    compute_dtype: torch.dtype  # the packed kernel's activations
    # A layer int8 leaves packed, with a float copy instead (`KernelPlan.fallback`): the rows it takes the copy
    # from, inside the large steps' graph; 0: no such copy.
    fallback_from_rows: int = 0

    def keep_dense_copy(self, dense: DenseCopy | None, values: Callable[[], torch.Tensor],
                        smoothing: torch.Tensor | None = None, fallback: DenseCopy | None = None) -> None:
        """`values()`: the dequantized weight [out, in], made only when a copy is kept. An int8 copy is
        kept only with its `smoothing` (gpu/calibration.py): the weight's input channels are multiplied by
        it and the activations' divided, so that a few large activation channels do not take all of a
        row's 8 bits. Without one, the layer keeps the `fallback` float copy if given (the large steps' graph
        takes it from the fallback's own row count, `fallback_from_rows`), else no copy."""
        weight = scales = input_scales = None
        self.fallback_from_rows = 0
        if dense is not None and dense.dtype == torch.int8 and smoothing is None and fallback is not None:
            weight = values().to(fallback.dtype)
            self.fallback_from_rows = max(fallback.from_rows, dense.from_rows)
        elif dense is not None and dense.dtype == torch.int8 and smoothing is not None:
            int8_values, int8_scales = int8_per_row(values().float() * smoothing.float(),
                                                    dense.int8_precision.weight_levels)
            input_scales = 1.0 / smoothing.float()
            if dense.int8_gemm == "fbgemm":
                self.fbgemm_weight = FbgemmWeight(int8_values, int8_scales)
            else:
                weight, scales = int8_values.t().contiguous(), int8_scales
        elif dense is not None and dense.dtype != torch.int8:
            weight = values().to(dense.dtype)
        self.register_buffer("dense_weight", weight)
        self.register_buffer("dense_scales", scales)
        self.register_buffer("dense_input_scales", input_scales)
        self.dense_from_rows = dense.from_rows if dense is not None and self.has_dense_copy else 0

    @property
    def has_dense_copy(self) -> bool:
        return self.dense_weight is not None or self.fbgemm_weight is not None

    def takes_dense(self, x: torch.Tensor) -> bool:
        """From `dense_from_rows` rows on. Inside a compiled graph the rows are a symbol: the copy is taken
        only where the graph asserts the step reaches that many tokens (gpu/compiled.py), never where it may
        not (an LM head's kept rows: it switches when the step runs, see `rows_switched_int8`)."""
        if not self.has_dense_copy:
            return False
        rows = math.prod(x.shape[:-1])
        if torch.compiler.is_compiling():
            return statically_known_true(rows >= self.dense_from_rows)
        return rows >= self.dense_from_rows

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback_from_rows:
            return self.fallback_forward(x)
        if self.dense_input_scales is not None:  # an int8 copy
            smoothed = x.reshape(-1, x.shape[-1]).float() * self.dense_input_scales
            if self.fbgemm_weight is not None:
                out = fbgemm_dynamic_linear(smoothed, self.fbgemm_weight)
            else:
                assert self.dense_weight is not None and self.dense_scales is not None
                out = int8_dynamic_linear(smoothed, self.dense_weight, self.dense_scales)
            out = out.view(*x.shape[:-1], out.shape[-1])
        else:
            assert self.dense_weight is not None
            out = float_copy_linear(x, self.dense_weight)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def fallback_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A step of the large steps' graph in a layer int8 leaves packed: its float copy from
        `fallback_from_rows` rows on, the packed kernel below, chosen when the step runs where the graph
        cannot know the rows against that count."""
        flat, rows = x.reshape(-1, x.shape[-1]), math.prod(x.shape[:-1])
        assert self.dense_weight is not None
        if torch.compiler.is_compiling() and not statically_known_true(rows >= self.fallback_from_rows):
            out = self.rows_switched(flat, self.fallback_from_rows)
        elif rows >= self.fallback_from_rows:
            out = float_copy_linear(flat, self.dense_weight)
        else:
            out = self.packed_forward(flat)
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def packed_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """The packed kernel's product of rows [rows, in], without the bias: [rows, out]. Each packed layer
        has its own; a layer with none (the plan's timing of a dense copy alone) never keeps a fallback."""
        raise TypeError(f"{type(self).__name__} has no packed kernel")

    def rows_switched(self, flat: torch.Tensor, from_rows: int) -> torch.Tensor:
        """The registered op choosing when the step runs: the float copy from `from_rows` rows on, the packed
        kernel below."""
        raise TypeError(f"{type(self).__name__} has no packed kernel")


def float_copy_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A float dense copy's multiply, in the copy's dtype."""
    return nn.functional.linear(x.to(weight.dtype), weight)


def int8_per_row(weight: torch.Tensor, levels: int = INT8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 values within ±levels and a float32 scale per row: weight ~= values * scales[:, None]."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / levels
    return torch.round(weight / scales[:, None]).clamp(-levels, levels).to(torch.int8), scales


def int8_dynamic_linear(x: torch.Tensor, weight_t: torch.Tensor, scales: torch.Tensor,
                        levels: int = INT8_LEVELS) -> torch.Tensor:
    """x [rows, in] @ (weight_t * scales)^T, x quantized to ±levels a row at a time: float32 [rows, out].
    With an fbgemm copy's weights, the same numbers as `fbgemm_dynamic_linear`'s."""
    x_values, x_scales = int8_per_row(x, levels)
    return torch._int_mm(x_values, weight_t).float() * x_scales[:, None] * scales


def fbgemm_available() -> bool:
    """Whether this torch has fbgemm's int8 linear kernels (x86 builds; the quantized engines may go)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


_FBGEMM_WEIGHTS: dict[int, Any] = {}  # handle -> fbgemm's packed weight, while its FbgemmWeight lives
_fbgemm_handles = itertools.count()


class FbgemmWeight:
    """int8 values [out, in] and a scale per output row, packed once for fbgemm. A compiled graph passes
    `handle` to `fairlane::fbgemm_int8_mm` (a packed weight is a script object, which no graph takes);
    the packed weight is dropped with its holder, and a copy of the holder packs its own."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        zero_points = torch.zeros(values.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, but fbgemm's packing takes no other
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(values.cpu(), scales.double().cpu(), zero_points, 0)
            packed = torch.ops.quantized.linear_prepack(weight, None)
        self.out_features = values.shape[0]
        self.nbytes = values.numel() + 4 * values.shape[0]  # int8 values and a float32 scale per row, packed
        self.handle = next(_fbgemm_handles)
        _FBGEMM_WEIGHTS[self.handle] = packed
        weakref.finalize(self, _FBGEMM_WEIGHTS.pop, self.handle, None)

    def __deepcopy__(self, memo: dict[int, Any]) -> FbgemmWeight:
        return FbgemmWeight(*self.unpacked())

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 values [out, in] and float32 scales it was packed from."""
        weight, _ = torch.ops.quantized.linear_unpack(_FBGEMM_WEIGHTS[self.handle])
        return weight.int_repr(), weight.q_per_channel_scales().float()


def fbgemm_dynamic_linear(x: torch.Tensor, weight: FbgemmWeight) -> torch.Tensor:
    """x [rows, in] float32 @ the packed weight^T, x quantized to int8 a row at a time: float32 [rows, out].
    The row scales are taken here, where a compiled step fuses them with the ops before; fbgemm rounds."""
    x_scales = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / _FBGEMM_LEVELS
    out: torch.Tensor = torch.ops.fairlane.fbgemm_int8_mm(x / x_scales, weight.handle, weight.out_features)
    return out * x_scales


def fbgemm_int8_mm(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """x: float32 activations already within ±levels, each row in its own scale; the weight's scales applied."""
    out: torch.Tensor = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x.contiguous(), 1.0, _FBGEMM_ZERO_POINT, _FBGEMM_WEIGHTS[handle])
    return out


def kernel_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activation dtype the packed kernels run fast in (see the module's note)."""
    return torch.bfloat16 if device.type == "cpu" and dtype == torch.float32 else dtype


class Int8WeightOnlyLinear(PackedLinear):
    """y = x @ (q * scale)^T (+ bias), q int8 per output row."""

    def __init__(self, linear: nn.Linear, dense: DenseCopy | None = None,
                 smoothing: torch.Tensor | None = None, fallback: DenseCopy | None = None) -> None:
        super().__init__()
        quantized, scales = int8_per_row(linear.weight.detach())
        self.compute_dtype = kernel_dtype(linear.weight.dtype, linear.weight.device)
        self.register_buffer("weight_int8", quantized)
        kernel_scales = scales.to(self.compute_dtype)
        self.register_buffer("scales", kernel_scales)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.keep_dense_copy(dense, lambda: quantized.float() * kernel_scales.float()[:, None], smoothing, fallback)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_dense(x):
            return self.dense_forward(x)
        flat = x.reshape(-1, x.shape[-1])
        if self.switches_at_run_time and self.dense_weight is not None and torch.compiler.is_compiling():
            out = self.rows_switched(flat, self.dense_from_rows)
        else:
            out = self.packed_forward(flat)
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def packed_forward(self, flat: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat.to(self.compute_dtype), self.weight_int8,
                                                               self.scales)
        return out

    def rows_switched(self, flat: torch.Tensor, from_rows: int) -> torch.Tensor:
        out: torch.Tensor = torch.ops.fairlane.rows_switched_int8(flat.to(self.compute_dtype), self.weight_int8,
                                                                  self.scales, self.dense_weight, from_rows)
        return out


def rows_switched_int8(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor,
                       dense_weight: torch.Tensor, from_rows: int) -> torch.Tensor:
    """An int8 layer's multiply for rows a compiled graph cannot know (an LM head's kept rows), chosen when
    the step runs: its float dense copy from `from_rows` rows on, the packed kernel below. In the
    compute dtype."""
    if x.shape[0] >= from_rows:
        return float_copy_linear(x, dense_weight).to(x.dtype)
    out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, weight_int8, scales)
    return out


def rows_switched_int4(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                       dense_weight: torch.Tensor, from_rows: int) -> torch.Tensor:
    """An int4 layer's multiply where a compiled graph cannot know the rows against its float copy's row count
    (`PackedLinear.fallback_forward`), chosen when the step runs. In the compute dtype."""
    if x.shape[0] >= from_rows:
        return float_copy_linear(x, dense_weight).to(x.dtype)
    return int4_packed_mm(x, packed, group_size, scales_and_zeros)


def int4_packed_mm(flat: torch.Tensor, packed: torch.Tensor, group_size: int,
                   scales_and_zeros: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor
    if flat.is_cuda:
        out = torch.ops.aten._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group_size, scales_and_zeros)
    return out


def _define_ops() -> Any:
    """`fairlane::rows_switched_int8`, opaque to inductor: inside it the row count is a plain int, so the
    choice is made at run time in both compiled graphs, with no graph per choice. And
    `fairlane::fbgemm_int8_mm`, an extern call in a compiled graph (inductor has no lowering of fbgemm's)."""
    library = torch.library.Library("fairlane", "FRAGMENT")  # type: ignore[no-untyped-call]
    library.define("rows_switched_int8(Tensor x, Tensor weight_int8, Tensor scales, Tensor dense_weight, "  # type: ignore[no-untyped-call]
                   "int from_rows) -> Tensor")
    library.impl("rows_switched_int8", rows_switched_int8, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    def shape(x: torch.Tensor, weight_int8: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight_int8.shape[0]))

    torch.library.register_fake("fairlane::rows_switched_int8", shape, lib=library)
    library.define("rows_switched_int4(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, "  # type: ignore[no-untyped-call]
                   "Tensor dense_weight, int from_rows) -> Tensor")
    library.impl("rows_switched_int4", rows_switched_int4, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    def int4_shape(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                   dense_weight: torch.Tensor, from_rows: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], dense_weight.shape[0]))

    torch.library.register_fake("fairlane::rows_switched_int4", int4_shape, lib=library)
    library.define("fbgemm_int8_mm(Tensor x, int handle, int out_features) -> Tensor")  # type: ignore[no-untyped-call]
    library.impl("fbgemm_int8_mm", fbgemm_int8_mm, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    def fbgemm_shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    torch.library.register_fake("fairlane::fbgemm_int8_mm", fbgemm_shape, lib=library)
    return library


_LIBRARY = _define_ops()  # kept alive: the op lives as long as its library object


def int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization per group: (q in 0..15 [N, K], scales [N, K/g], minimums [N, K/g]),
    with weight ~= q * scale + minimum."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    minimums = groups.amin(dim=-1)
    scales = ((groups.amax(dim=-1) - minimums) / 15.0).clamp(min=1e-12)
    q = torch.round((groups - minimums[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(rows, cols), scales, minimums


class Int4WeightOnlyLinear(PackedLinear):
    """y = x @ W^T (+ bias) with W stored as 4-bit groups; the kernel computes (q - 8) * scale + zero."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [K/g, N, 2]

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE, dense: DenseCopy | None = None,
                 smoothing: torch.Tensor | None = None, fallback: DenseCopy | None = None) -> None:
        super().__init__()
        q, scales, minimums = int4_groups(linear.weight.detach(), group_size)
        zeros = minimums + 8.0 * scales
        self.compute_dtype = torch.bfloat16  # the CUDA kernel takes nothing else; the CPU one is fastest in it
        self.register_buffer("packed", _pack_int4(q, linear.weight.device))
        # [K/g, N, 2]: the kernels' layout of a group's (scale, zero)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(self.compute_dtype)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.group_size = group_size
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.keep_dense_copy(dense, lambda: int4_dequantized(q, scales_and_zeros, group_size), smoothing, fallback)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_dense(x):
            return self.dense_forward(x)
        out = self.packed_forward(x.reshape(-1, x.shape[-1]))
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def packed_forward(self, flat: torch.Tensor) -> torch.Tensor:
        return int4_packed_mm(flat.to(self.compute_dtype), self.packed, self.group_size, self.scales_and_zeros)

    def rows_switched(self, flat: torch.Tensor, from_rows: int) -> torch.Tensor:
        out: torch.Tensor = torch.ops.fairlane.rows_switched_int4(flat.to(self.compute_dtype), self.packed,
                                                                  self.group_size, self.scales_and_zeros,
                                                                  self.dense_weight, from_rows)
        return out


def int4_dequantized(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q - 8) * scale + zero per group, with the kernel's own (bfloat16) scales and zeros: [N, K] float32."""
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g] each
    rows, cols = q.shape
    groups = (q.float() - 8.0).reshape(rows, cols // group_size, group_size)
    return (groups * scales[..., None] + zeros[..., None]).reshape(rows, cols)


def _pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    packed: torch.Tensor
    if device.type == "cuda":
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        # The CUDA packing tiles the input dimension by 16 * inner_k_tiles (2, 4 or 8): take the widest that divides.
        inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed


def fits_kernel(linear: nn.Linear, mode: Quantization) -> bool:
    if mode == "int4":  # groups of 32 along the input (also a multiple of the CUDA packing's 32), rows by 64
        return linear.in_features % INT4_GROUP_SIZE == 0 and linear.out_features % INT4_ROW_MULTIPLE == 0
    return True


def layer_modes(model: Any, mode: Quantization) -> dict[str, Quantization]:
    """The packed kernel of each linear layer (the LM head included) that one can take, by module name."""
    if mode == "none":
        return {}
    head = model.get_output_embeddings()
    modes: dict[str, Quantization] = {name: ("int8" if linear is head else mode)  # see the module's note on the head
                                      for name, linear in model.named_modules() if isinstance(linear, nn.Linear)}
    return {name: layer_mode for name, layer_mode in modes.items()
            if fits_kernel(model.get_submodule(name), layer_mode)}


def packed_linear(linear: nn.Linear, mode: Quantization, dense: DenseCopy | None = None,
                  smoothing: torch.Tensor | None = None, fallback: DenseCopy | None = None) -> PackedLinear:
    if mode == "int8":
        return Int8WeightOnlyLinear(linear, dense, smoothing, fallback)
    return Int4WeightOnlyLinear(linear, dense=dense, smoothing=smoothing, fallback=fallback)


def quantize_linears(model: Any, mode: Quantization, dense: DenseCopy | None = None,
                     smoothing: Mapping[str, torch.Tensor] | None = None, head: DenseCopy | None = None,
                     fallback: DenseCopy | None = None) -> int:
    """Replace every nn.Linear of the model (the LM head included) in place, each with the dense copy
    asked for, if any (an int8 copy only for the layers `smoothing` names, the others `fallback`'s float
    copy if given); the LM head with `head`'s, chosen by its rows when the step runs. Returns how many were
    replaced."""
    modes = layer_modes(model, mode)
    kept = [name for name, linear in model.named_modules() if isinstance(linear, nn.Linear) and name not in modes]
    if kept and mode != "none":
        logger.info("%s: %d linear layer(s) keep float weights (shape the kernel cannot take): %s",
                    mode, len(kept), ", ".join(kept[:4]))
    head_name = head_layer_name(model)
    for name, layer_mode in modes.items():
        if name == head_name:
            layer = packed_linear(model.get_submodule(name), layer_mode, head)
            layer.switches_at_run_time = isinstance(layer, Int8WeightOnlyLinear)
        else:
            layer_smoothing = None if smoothing is None else smoothing.get(name)
            layer = packed_linear(model.get_submodule(name), layer_mode, dense, layer_smoothing, fallback)
        model.set_submodule(name, layer)
    return len(modes)


def head_layer_name(model: Any) -> str | None:
    """The module name of the model's LM head, if it is a linear layer."""
    head = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is head and isinstance(head, nn.Linear)),
                None)
