"""`fairlane bench kernels`: each linear kernel the runner could use, timed at the model's own shapes for
the row counts a step has (1: one decode; 8 and 64: batches of decodes; 512: a prompt chunk).

A step multiplies every linear layer once, so what a kernel costs a step is its time at each of the
model's (in, out) shapes, times how many layers have that shape, added up. The kernels:
- float32 and bfloat16: the dense weight (bfloat16 is native only where the CPU has AVX512-BF16 or AMX;
  AVX2 emulates it);
- int4 and int8: the weight-only packed kernels of gpu/quantization.py (int4's activations in bfloat16;
  a shape it cannot take stays float32, as in serving);
- int8-dynamic: int8 weights times activations quantized to int8 per row on the fly (`aten._int_mm`):
  the int8 copies of gpu/quantization.py, which llama.cpp's CPU backend does per block of 32 instead.
Which kernel is fastest depends on the CPU and the row count, so the table names the CPU, its
instruction sets and the load average; the choice a server makes from it must be made on the machine
it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.process.flags import add_model_flags, settings_from_args
from benchmarks.bench_compile import machine_description
from gpu.linear_kernels import DenseMultiply, cold_multiply, median_seconds
from gpu.models import load_model
from gpu.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear, fits_kernel

KERNELS = ("float32", "bfloat16", "int4", "int8", "int8-dynamic")
ROWS = (1, 8, 64, 512)
Shape = tuple[int, int]  # (in_features, out_features)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("kernels", help="linear kernels timed at the model's shapes and step row counts")
    add_model_flags(parser)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows (tokens) per step to time")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"kernels to time, of {', '.join(KERNELS)}")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="time each case at least this long")
    parser.add_argument("--out", help="write the JSON report here")
    parser.set_defaults(handler=run_command)


def linear_shapes(model: nn.Module) -> Counter[Shape]:
    """How many linear layers of each (in, out) shape the model has, its LM head included."""
    return Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear))


def multiply_of(kernel: str, linear: nn.Linear) -> tuple[nn.Module, torch.dtype] | None:
    """The kernel's module for this layer and the dtype it takes activations in; None where it cannot."""
    if kernel == "float32":
        return linear, torch.float32
    if kernel == "bfloat16":
        return nn.Linear(linear.in_features, linear.out_features, bias=False, dtype=torch.bfloat16), torch.bfloat16
    if kernel == "int4":  # a layer the kernel cannot take keeps its float weight, as quantize_linears does
        return (Int4WeightOnlyLinear(linear) if fits_kernel(linear, "int4") else linear), torch.float32
    if kernel == "int8":
        return Int8WeightOnlyLinear(linear), torch.float32
    if kernel == "int8-dynamic":
        return DenseMultiply(linear, torch.int8), torch.float32  # an int8 copy, unsmoothed
    raise ValueError(f"unknown kernel {kernel!r}")


def time_kernel(kernel: str, shape: Shape, rows: int, min_seconds: float, num_layers: int) -> float | None:
    """One layer's median time, each call on another copy of it (as the server's plan times them): a
    step reads every layer's weights from memory, not from the cache."""
    linear = nn.Linear(*shape, bias=False)
    made = multiply_of(kernel, linear)
    if made is None:
        return None
    layer, dtype = made
    x = torch.randn(rows, shape[0], dtype=dtype)
    try:
        with torch.inference_mode():
            return median_seconds(cold_multiply(layer, num_layers), x, min_seconds)
    except RuntimeError:  # a kernel this build of torch lacks on this device
        return None


def measure(shapes: Counter[Shape], kernels: list[str], rows: list[int], min_seconds: float) -> dict[str, Any]:
    """Per row count and kernel: milliseconds of all the model's linear layers (None: it cannot take them
    all), and per shape the median milliseconds of one layer."""
    per_shape: dict[str, dict[str, dict[str, float | None]]] = {}
    totals: dict[str, dict[str, float | None]] = {}
    for count in rows:
        totals[str(count)] = {}
        for kernel in kernels:
            total: float | None = 0.0
            for shape, num_layers in shapes.items():
                seconds = time_kernel(kernel, shape, count, min_seconds, num_layers)
                per_shape.setdefault(f"{shape[0]}x{shape[1]}", {}).setdefault(str(count), {})[kernel] = (
                    None if seconds is None else round(seconds * 1e3, 4))
                total = None if seconds is None or total is None else total + seconds * num_layers
            totals[str(count)][kernel] = None if total is None else round(total * 1e3, 3)
    return {"step_linears_ms": totals, "per_shape_ms": per_shape}


def fastest(row: dict[str, float | None]) -> str:
    timed = {kernel: ms for kernel, ms in row.items() if ms is not None}
    return min(timed, key=lambda kernel: timed[kernel]) if timed else "-"


def table(report: dict[str, Any]) -> str:
    kernels = report["kernels"]
    lines = ["| rows | " + " | ".join(f"{k} (ms)" for k in kernels) + " | fastest |",
             "|---" * (len(kernels) + 2) + "|"]
    for count, row in report["step_linears_ms"].items():
        cells = ["-" if row[k] is None else f"{row[k]:.2f}" for k in kernels]
        lines.append(f"| {count} | " + " | ".join(cells) + f" | {fastest(row)} |")
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    torch.manual_seed(0)
    loaded = load_model(settings.model, device="cpu", dtype="float32", cache_dir=settings.model_cache_dir)
    shapes = linear_shapes(loaded.model)
    kernels = args.kernels.split(",")
    report: dict[str, Any] = {
        "model": settings.model, "threads": torch.get_num_threads(), "machine": machine_description(),
        "load_average_before": os.getloadavg()[0], "kernels": kernels,
        "shapes": {f"{i}x{o}": n for (i, o), n in shapes.items()},
        **measure(shapes, kernels, [int(r) for r in args.rows.split(",")], args.min_seconds),
        "load_average_after": os.getloadavg()[0]}
    machine = report["machine"]
    print(f"{settings.model}: every linear layer of one step, {report['threads']} threads, {machine.get('cpu', '?')} "
          f"({' '.join(machine.get('instruction_sets', []))}), load {report['load_average_before']:.2f}")
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
