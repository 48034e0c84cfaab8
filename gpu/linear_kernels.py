"""Which kernel multiplies the packed linear layers' weights, by a step's row count, chosen on this machine.

The packed weight-only kernels (gpu/quantization.py) win where a step reads more than it computes: a
decode step of a few rows. A prompt chunk or a batch of many decodes computes more than it reads, and
there a dense GEMM over the same dequantized values can be the faster one: on an AVX2 EPYC, SmolLM2's
step linears at 512 rows took 0.91 s in float32 against 1.90 s in int4 (`fairlane bench kernels`,
docs/benchmarks/kernels.md); on another CPU the crossing moves, or never comes. So at start the runner
times both at the model's own shapes for a ladder of row counts (`ROW_BUCKETS`) and keeps a dense copy
of every packed layer only when it wins from some row count on (`KernelPlan.dense_from_rows`), by the
margin a step on it must make up for running eagerly (`DENSE_MARGIN`). Each layer is timed over copies
of itself that outgrow the cache, as a step reads its weights from memory. The copy costs its dtype's
bytes per weight beside the packed ones (float32: 4, bfloat16: 2, against int4's half byte) and is
logged. The measurement takes seconds and is kept on disk, keyed by the machine, the thread count, the
torch version and the layer shapes; a measurement whose timings fall as rows grow was taken beside other
work, and is taken again, and kept only once consistent.

Where int8 copies win, the layers whose int8 product errs past the calibration's bound keep none
(gpu/calibration.py): on SmolLM2 34 of 210, the MLPs' down projections among them, 28% of the step's
weights. On the packed kernel, whose time grows with every row, they took 16 of a 90-token prompt step's
40 ms on a Zen 5 EPYC. So the plan times the float copies on up the buckets past the int8 decision, and
those layers keep the fastest one from where it wins (`KernelPlan.fallback`), chosen when the step runs
inside the large steps' graph (`fairlane::rows_switched_int4`): below that row count the packed kernel
still wins (their decode batches), above it the copy does, by more with every row.

The dense dtypes tried: the model's own; bfloat16 where the hardware multiplies it natively
(AVX512-BF16 or AMX, or a GPU; AVX2 emulates it at 7x float32's time); and on a CPU, int8 copies
multiplied with int8 activations (gpu/quantization.py), which need VNNI's integer dot products to win.
On a Zen 4 EPYC with AVX512-BF16 and VNNI, SmolLM2's step linears took, at 8, 16 and 64 rows:

| rows | packed int4 | int8 copies | bfloat16 copies |
|---|---|---|---|
| 8 | 18.6 ms | 17.7 ms | 25.4 ms |
| 16 | 32.6 ms | 23.4 ms | 31.1 ms |
| 64 | 120.5 ms | 45.2 ms | 64.3 ms |

Int8 copies on fbgemm's kernels (gpu/quantization.py) are a candidate only under `auto-fbgemm`. On a
Zen 1 EPYC (AVX2, no VNNI) they multiply SmolLM2's step linears in 26-29 ms at 1 row, 32-36 at 4 and
46 at 8, against the packed kernels' 28-35, 48-58 and 90, at the perplexity of the packed kernels. But
the plan takes a copy for every layer, where only the calibrated layers keep an int8 one (148 of 210
there); the others, the MLPs' larger projections among them, keep the packed kernels at every row
count, where `auto` gives every layer float32 copies from 24 rows there, which the plan's timing never
sees. In one process an eager forward on fbgemm copies from one row took 90.7 ms against 64.2 on the
packed kernels alone at 1 row, and 250 against 219 at 16; served, a lone stream's ITL p50 read 44 ms
against 39 on `auto`'s plan twelve minutes later (that machine's lone decode read 31-44 ms over the
day's runs). Until the plan times what the step runs (the erring layers on their own best kernel, the
copies' extern calls), `auto` leaves fbgemm out.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gpu.compiled import machine_key
from gpu.quantization import (
    FBGEMM_PRECISION,
    DenseCopy,
    FbgemmWeight,
    PackedLinear,
    Quantization,
    fbgemm_available,
    fbgemm_dynamic_linear,
    head_layer_name,
    int8_per_row,
    layer_modes,
    packed_linear,
)

logger = logging.getLogger(__name__)

# auto: measured here; auto-fbgemm: the same with int8 copies on fbgemm among the candidates (below);
# packed: the packed kernels at every row count
LinearKernels = Literal["auto", "auto-fbgemm", "packed"]
# Steps of 8-16 rows are a decode batch beside a few interactive streams (scheduling/step_shaper.py): the
# buckets there are close, for a copy that wins from 12 rows not to wait for 16.
ROW_BUCKETS = (1, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512)
# Rows a dense copy must win at in a row before the plan takes it: one bucket alone may be noise.
CONFIRMING_BUCKETS = 2
# A win is this fraction of the packed kernels' time or less: clear of the timings' noise, and of what a
# step on the copies costs beside its linears (the fused quantization of an int8 copy's activations and a
# second compiled graph's dispatch are not timed).
DENSE_MARGIN = 0.9
MIN_SECONDS = 0.02  # each layout timed at least this long per kernel and bucket
COLD_BYTES = 256 * 2**20  # the weights a layout's timing cycles through: more than a CPU's last-level cache
HEAD_COPIES = 64  # at most: the head's timing cycles through COLD_BYTES of copies, as a step's layers would
# A measurement whose timings fall as rows grow (`falling_timings`) is taken again, up to this many times,
# and kept on disk only once consistent: a plan measured beside other work would be kept for every start.
MEASURING_ATTEMPTS = 3
RISE_SLACK = 0.75  # a kernel's time at more rows may read this fraction of its time at fewer, no less
NOISE_FLOOR_MS = 1.0  # falls smaller than this are a small model's timing noise, not a busy machine
FBGEMM_KERNEL = "int8_fbgemm"  # an int8 copy multiplied on fbgemm's kernels (gpu/quantization.py)
Layout = tuple[int, int, Quantization]  # (in_features, out_features, the packed kernel)
Multiply = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The dense copy the packed layers keep, if any (from its row count on a step multiplies it; below,
    the packed weights). None: the packed kernels at every row count (or nothing is packed)."""

    dense: DenseCopy | None = None
    step_linears_ms: dict[int, dict[str, float]] | None = None  # per bucket, per kernel: as measured
    # The LM head's own float copy, planned apart: its rows are the logits a step keeps (its decodes, and a
    # prompt chunk's last token), not the step's tokens, so it chooses when the step runs (gpu/quantization.py).
    head: DenseCopy | None = None
    head_ms: dict[int, dict[str, float]] | None = None  # the head alone, per bucket, per kernel
    # Beside int8 copies: a float copy of the layers the calibration leaves on the packed kernel (their int8
    # product errs past its bound, gpu/calibration.py), taken in the large steps' graph from its row count on,
    # chosen when the step runs (`rows_switched_int4`). None: those layers stay packed at every row count.
    fallback: DenseCopy | None = None

    @property
    def dense_dtype(self) -> torch.dtype | None:
        return None if self.dense is None else self.dense.dtype

    @property
    def dense_from_rows(self) -> int | None:
        return None if self.dense is None else self.dense.from_rows

    def takes_dense(self, rows: int) -> bool:
        return self.dense_from_rows is not None and rows >= self.dense_from_rows

    def graph_variant(self) -> str:
        """What of the plan a compiled graph depends on: each copy's kernel and the rows it is taken from."""
        copies = (("dense", self.dense), ("head", self.head), ("fallback", self.fallback))
        return "".join(f"+{name}-{kernel_name(copy)}-from{copy.from_rows}" for name, copy in copies if copy is not None)

    def describe(self) -> str:
        if self.dense is None:
            layers = "packed kernels at every row count"
        elif self.dense.from_rows <= 1:  # the packed kernels only in the layers that keep no copy
            layers = f"{kernel_name(self.dense)} copies at every row count"
        else:
            layers = f"packed kernels below {self.dense.from_rows} rows, {kernel_name(self.dense)} copies from there"
        if self.fallback is not None:
            layers += (f"; the layers without one packed below {self.fallback.from_rows} rows, "
                       f"{kernel_name(self.fallback)} copies from there")
        if self.head is None:
            return layers
        return f"{layers}; the LM head packed below {self.head.from_rows} kept rows, {self.head.dtype} from there"


def packed_layouts(model: nn.Module, mode: Quantization) -> Counter[Layout]:
    """How many layers of each (in, out) shape each packed kernel takes, the LM head apart (`head_layout`)."""
    head = head_layer_name(model)
    linears = [(model.get_submodule(name), layer_mode) for name, layer_mode in layer_modes(model, mode).items()
               if name != head]
    return Counter((linear.in_features, linear.out_features, layer_mode)
                   for linear, layer_mode in linears if isinstance(linear, nn.Linear))


def head_layout(model: nn.Module, mode: Quantization) -> Layout | None:
    """The LM head's layout where it is packed on the int8 kernel (the only one that switches by its rows)."""
    name = head_layer_name(model)
    layer_mode = layer_modes(model, mode).get(name or "")
    if name is None or layer_mode != "int8":
        return None
    head = model.get_submodule(name)
    assert isinstance(head, nn.Linear)
    return head.in_features, head.out_features, layer_mode


def dense_candidates(model_dtype: torch.dtype, native_bfloat16: bool, device: torch.device,
                     fbgemm: bool = False, int8_dot_products: bool = True) -> list[str]:
    """The dense copies' kernels worth timing: int8 copies on a CPU only (CUDA's `_int_mm` wants more than 16
    rows), on `_int_mm` where the CPU has integer dot products (without them it is a plain loop, 641 ms for
    SmolLM2's step linears at 8 rows on a Zen 1 EPYC, and its timing took most of the plan's 15-20 s there)
    and, when asked and this torch has it, on fbgemm (the module's note on fbgemm)."""
    candidates = [dtype_name(model_dtype)]
    if native_bfloat16 and model_dtype != torch.bfloat16:
        candidates.append("bfloat16")
    if device.type == "cpu":
        candidates += [*(["int8"] if int8_dot_products else []),
                       *([FBGEMM_KERNEL] if fbgemm and fbgemm_available() else [])]
    return candidates


def dense_copy_of(kernel: str, from_rows: int) -> DenseCopy:
    """The dense copy a kernel's name stands for (a dtype's name, or FBGEMM_KERNEL)."""
    if kernel == FBGEMM_KERNEL:
        return DenseCopy(torch.int8, from_rows, "fbgemm")
    return DenseCopy(getattr(torch, kernel), from_rows)


def kernel_name(copy: DenseCopy) -> str:
    return FBGEMM_KERNEL if copy.int8_gemm == "fbgemm" else dtype_name(copy.dtype)


def median_seconds(multiply: Multiply, x: torch.Tensor, min_seconds: float, min_runs: int = 5) -> float:
    """The median time of one call, after warm-up calls, over at least min_runs calls and min_seconds."""
    for _ in range(2):
        multiply(x)
    times: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < min_seconds or len(times) < min_runs:
        begin = time.perf_counter()
        multiply(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def time_layouts(layers: dict[Layout, nn.Linear], counts: Counter[Layout], rows: int, kernel: str,
                 min_seconds: float) -> float:
    """Seconds of every packed layer of one step at this row count, on the packed kernel or a dense dtype,
    from one sample layer of each layout (`sample_layers`). Each call multiplies another copy of the layer,
    as a step reads each layer's weights once from memory: timed over one weight, the kernels read it from
    the cache, and on a Zen 4 EPYC bfloat16 copies then won from 8 rows, where a real step's took more than
    twice the packed kernel's time."""
    return sum(time_layer(linear, layout[2], rows, kernel, counts[layout], min_seconds) * counts[layout]
               for layout, linear in layers.items())


def time_layer(linear: nn.Linear, mode: Quantization, rows: int, kernel: str, count: int,
               min_seconds: float) -> float:
    """Seconds of one multiply of the layer at this row count, over copies enough to read it from memory
    as a step of `count` such layers would."""
    made: nn.Module
    shape, device = (rows, linear.in_features), linear.weight.device
    if kernel == "int8":
        made, x = Int8CopyMultiply(linear), torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    elif kernel == FBGEMM_KERNEL:
        made, x = FbgemmCopyMultiply(linear), torch.randn(shape, device=device)
    else:
        made = packed_linear(linear, mode) if kernel == "packed" else DenseMultiply(linear, getattr(torch, kernel))
        x = torch.randn(shape, device=device, dtype=linear.weight.dtype)
    with torch.inference_mode():
        return median_seconds(cold_multiply(made, count), x, min_seconds, min_runs=3)


def sample_layers(layouts: Counter[Layout], device: torch.device, dtype: torch.dtype) -> dict[Layout, nn.Linear]:
    """One random layer of each layout, made once for every kernel and row count timed: a large one's
    initialization (an LM head's) costs more than its timings."""
    return {layout: nn.Linear(layout[0], layout[1], bias=False, device=device, dtype=dtype) for layout in layouts}


def num_copies(layer: nn.Module, count: int) -> int:
    """Copies enough to outgrow a CPU's last-level cache, and no more than the model has layers of the shape."""
    weight_bytes = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()]) or 1
    return max(1, min(count, -(-COLD_BYTES // weight_bytes)))


def cold_multiply(layer: nn.Module, count: int) -> Multiply:
    """The layer's multiply, each call on the next of `num_copies` copies of it, in turn: timed so, a kernel
    reads the weights from memory, as in a step of `count` such layers."""
    copies = [layer, *(copy.deepcopy(layer) for _ in range(num_copies(layer, count) - 1))]
    turn = itertools.cycle(copies)
    return lambda x: next(turn)(x)


class DenseMultiply(PackedLinear):
    """A layer's weight in a dense dtype, multiplied in it: what a dense copy does."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.bias = None
        smoothing = torch.ones(linear.in_features, device=linear.weight.device)  # timed as a real copy's
        self.keep_dense_copy(DenseCopy(dtype, 1), lambda: linear.weight.detach(), smoothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_forward(x)


class Int8CopyMultiply(nn.Module):
    """An int8 copy's multiply as a compiled step runs it: inductor fuses the quantization of its activations
    into one pass with the ops before it, so it is timed from int8 activations. Eagerly that quantization is
    ten dispatches a layer, 60-100 us each layer on a Zen 4 EPYC (a multiply is 10-110 us): timed so, the
    copies lost to the packed kernels at 16 rows (34.5 against 26.2 ms a step's linears), where a compiled
    step on them won (38.3 against 43.5 ms a step). A runner that does not compile pays it."""

    weight: torch.Tensor  # [in, out] int8
    scales: torch.Tensor  # per output row, float32

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        copy_ = DenseMultiply(linear, torch.int8)
        assert copy_.dense_weight is not None and copy_.dense_scales is not None
        self.register_buffer("weight", copy_.dense_weight)
        self.register_buffer("scales", copy_.dense_scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(x, self.weight).float() * self.scales


class FbgemmCopyMultiply(nn.Module):
    """An int8 copy's multiply on fbgemm, its activations' row scales taken eagerly: in a compiled step the
    op is an extern call with a fused kernel before it, 31 us a layer beside fbgemm's own 86 at one row
    of 576 x 576 on a Zen 1 EPYC, about what these eager ops cost; timed from the op alone, the copies won
    at one row, where an eager forward on them then took 90.7 ms against the packed kernels' 64.2."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = FbgemmWeight(*int8_per_row(linear.weight.detach(), FBGEMM_PRECISION.weight_levels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fbgemm_dynamic_linear(x, self.weight)


StepTimer = Callable[[int, str], float]  # (rows, kernel: "packed" or a dense copy's kernel name) -> seconds


def measure_plan(time_step: StepTimer, candidates: list[str]) -> KernelPlan:
    """Times the packed kernels and each dense copy's kernel up the row buckets, until one has won
    CONFIRMING_BUCKETS buckets in a row: from the first of those on, it wins at larger steps too (the
    dense GEMM's advantage only grows with rows). Where int8 copies win, the float copies go on up the
    buckets from there, for the layers the calibration leaves packed (`KernelPlan.fallback`)."""
    timings: dict[int, dict[str, float]] = {}
    dense = first_confirmed_win(time_step, ["packed", *candidates], ROW_BUCKETS, timings)
    if dense is None:
        return KernelPlan(step_linears_ms=timings)
    floats = float_kernels(candidates)
    fallback = None
    if dense.dtype == torch.int8 and floats:
        larger = [rows for rows in ROW_BUCKETS if rows >= dense.from_rows]
        fallback = first_confirmed_win(time_step, ["packed", *floats], larger, timings)
    return KernelPlan(dense, timings, fallback=fallback)


def first_confirmed_win(time_step: StepTimer, kernels: list[str], buckets: list[int] | tuple[int, ...],
                        timings: dict[int, dict[str, float]]) -> DenseCopy | None:
    """The first dense kernel of `kernels` (packed first) to win CONFIRMING_BUCKETS buckets in a row, as a copy
    from the first of them; each timing taken once into `timings` (ms per bucket and kernel)."""
    streak: list[int] = []
    for rows in buckets:
        row = timings.setdefault(rows, {})
        for kernel in kernels:
            if kernel not in row:
                row[kernel] = round(time_step(rows, kernel) * 1e3, 3)
        fastest = min(kernels, key=lambda kernel: row[kernel])
        wins = fastest != "packed" and row[fastest] <= DENSE_MARGIN * row["packed"]
        streak = [*streak, rows] if wins else []
        if len(streak) >= CONFIRMING_BUCKETS:
            return dense_copy_of(fastest, streak[0])
    return None


def float_kernels(candidates: list[str]) -> list[str]:
    """The candidates whose copies are float (an int8 copy's activations are rounded)."""
    return [kernel for kernel in candidates if dense_copy_of(kernel, 1).dtype.is_floating_point]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_identity(layouts: Counter[Layout], candidates: list[str], device: torch.device,
                  model_dtype: torch.dtype, head: Layout | None = None) -> str:
    described = json.dumps({"layouts": sorted(map(list, layouts.items())), "candidates": candidates,
                            "head": None if head is None else [list(head), "float copies by kept rows"],
                            "dtype": str(model_dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
                            "buckets": ROW_BUCKETS, "machine": machine_key(device),
                            "timing": "weights cycled past the cache", "margin": DENSE_MARGIN,
                            "int8": "dynamic activations, calibrated layers only, timed from int8 activations",
                            "fallback": "float copies of the layers int8 leaves packed, by their own row count"},
                           default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def plan_as_json(plan: KernelPlan) -> dict[str, Any]:
    return {"dense_dtype": None if plan.dense_dtype is None else dtype_name(plan.dense_dtype),
            "dense_from_rows": plan.dense_from_rows,
            "dense_int8_gemm": None if plan.dense is None else plan.dense.int8_gemm,
            "step_linears_ms": {str(rows): row for rows, row in (plan.step_linears_ms or {}).items()},
            "head_dtype": None if plan.head is None else dtype_name(plan.head.dtype),
            "head_from_rows": None if plan.head is None else plan.head.from_rows,
            "head_ms": {str(rows): row for rows, row in (plan.head_ms or {}).items()},
            "fallback_dtype": None if plan.fallback is None else dtype_name(plan.fallback.dtype),
            "fallback_from_rows": None if plan.fallback is None else plan.fallback.from_rows}


def plan_from_json(data: dict[str, Any]) -> KernelPlan:
    def copy_of(dtype: str | None, from_rows: int | None) -> DenseCopy | None:
        return None if dtype is None or from_rows is None else DenseCopy(getattr(torch, dtype), from_rows)

    def timings(key: str) -> dict[int, dict[str, float]]:
        return {int(rows): row for rows, row in data.get(key, {}).items()}

    dense = copy_of(data.get("dense_dtype"), data.get("dense_from_rows"))
    if dense is not None and data.get("dense_int8_gemm") == "fbgemm":
        dense = dataclasses.replace(dense, int8_gemm="fbgemm")
    return KernelPlan(dense, timings("step_linears_ms"),
                      copy_of(data.get("head_dtype"), data.get("head_from_rows")), timings("head_ms"),
                      copy_of(data.get("fallback_dtype"), data.get("fallback_from_rows")))


def plan_linear_kernels(model: nn.Module, mode: Quantization, model_dtype: torch.dtype, device: torch.device, *,
                        native_bfloat16: bool, int8_dot_products: bool = True, choice: LinearKernels = "auto",
                        cache_dir: Path | None = None) -> KernelPlan:
    """The plan for this model's packed layers on this machine: measured, or read from where an earlier
    start on the same machine kept it."""
    layouts, head = packed_layouts(model, mode), head_layout(model, mode)
    if choice == "packed" or not (layouts or head):
        return KernelPlan()
    candidates = dense_candidates(model_dtype, native_bfloat16, device, fbgemm=choice == "auto-fbgemm",
                                  int8_dot_products=int8_dot_products)
    identity = plan_identity(layouts, candidates, device, model_dtype, head)
    cached = None if cache_dir is None else cache_dir / f"linear-kernels-{identity}.json"
    if cached is not None and cached.is_file():
        plan = plan_from_json(json.loads(cached.read_text()))
        logger.info("linear kernels (measured on this machine before, %s): %s", cached, plan.describe())
        return plan
    plan, consistent = measure_until_consistent(layouts, head, device, model_dtype, candidates)
    if cached is not None and consistent:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = cached.with_suffix(f".{time.monotonic_ns()}.tmp")
        staging.write_text(json.dumps(plan_as_json(plan), indent=1))
        staging.replace(cached)
    return plan


def measure_until_consistent(layouts: Counter[Layout], head: Layout | None, device: torch.device,
                             dtype: torch.dtype, candidates: list[str]) -> tuple[KernelPlan, bool]:
    """The plan, measured again while its timings fall as rows grow (up to MEASURING_ATTEMPTS times), and
    whether it ended consistent: only then is it worth keeping for later starts."""
    layers = sample_layers(layouts, device, dtype)
    for attempt in range(1, MEASURING_ATTEMPTS + 1):
        started = time.perf_counter()
        plan = measure_layers_and_head(layers, layouts, head, device, dtype, candidates)
        logger.info("linear kernels measured in %.1f s: %s (%s; the LM head: %s)", time.perf_counter() - started,
                    plan.describe(), timings_text(plan.step_linears_ms), timings_text(plan.head_ms))
        falls = falling_timings(plan)
        if not falls:
            return plan, True
        logger.warning("linear kernels: timings fell as rows grew (%s), as on a machine busy with other work; %s",
                       "; ".join(falls), "measuring again" if attempt < MEASURING_ATTEMPTS else
                       "this plan serves this start only and is measured again at the next")
    return plan, False


def measure_layers_and_head(layers: dict[Layout, nn.Linear], layouts: Counter[Layout], head: Layout | None,
                            device: torch.device, dtype: torch.dtype, candidates: list[str]) -> KernelPlan:
    plan = KernelPlan()
    if layouts:
        plan = measure_plan(lambda rows, kernel: time_layouts(layers, layouts, rows, kernel, MIN_SECONDS), candidates)
    if head is not None:
        head_plan = measure_head(head, device, dtype, candidates)
        plan = dataclasses.replace(plan, head=head_plan.dense, head_ms=head_plan.step_linears_ms)
    return plan


def falling_timings(plan: KernelPlan) -> list[str]:
    """Where a kernel's time fell as the rows grew, past the timings' noise: more rows never cost less, so
    such a plan was measured beside other work. A first start that measured while a compiler built beside
    it read the packed kernels at 8 rows 1,028 ms and at 12 rows 616 ms (73 and 100 ms measured quietly),
    and kept float32 copies from 128 rows, where the quiet measurement takes them from 24."""
    falls = []
    for name, timings in (("layers", plan.step_linears_ms or {}), ("LM head", plan.head_ms or {})):
        for fewer, more in itertools.pairwise(sorted(timings)):
            for kernel, before_ms in timings[fewer].items():
                after_ms = timings[more].get(kernel, before_ms)
                if after_ms < RISE_SLACK * before_ms and before_ms - after_ms > NOISE_FLOOR_MS:
                    falls.append(f"{name}, {kernel}: {fewer} rows {before_ms:.1f} ms, {more} rows {after_ms:.1f} ms")
    return falls


def measure_head(head: Layout, device: torch.device, dtype: torch.dtype, candidates: list[str]) -> KernelPlan:
    """The head's plan, on float copies only (an int8 copy's activations would round the logits), timed over
    copies of it that outgrow the cache: a step reads every other layer between two heads."""
    linear = sample_layers(Counter([head]), device, dtype)[head]
    return measure_plan(lambda rows, kernel: time_layer(linear, head[2], rows, kernel, HEAD_COPIES, MIN_SECONDS),
                        float_kernels(candidates))


def timings_text(timings: dict[int, dict[str, float]] | None) -> str:
    return "; ".join(f"{rows} rows: " + ", ".join(f"{k} {ms:.1f} ms" for k, ms in row.items())
                     for rows, row in (timings or {}).items()) or "not measured"


def dense_copy_bytes(model: nn.Module) -> int:
    return sum(_copy_bytes(m) for m in model.modules() if isinstance(m, PackedLinear))


def _copy_bytes(layer: PackedLinear) -> int:
    total = 0 if layer.fbgemm_weight is None else layer.fbgemm_weight.nbytes
    for tensor in (layer.dense_weight, layer.dense_scales):
        total += 0 if tensor is None else tensor.numel() * tensor.element_size()
    return total
