"""`fairlane bench compile`: the compiled forward's two scopes side by side, and eager beside them.

For each scope ("model": the whole step as one graph; "layer": regional compilation, one decoder
layer's graph shared by every layer) it measures, each in a fresh process:
- a cold compile into an empty artifact folder (what a first start pays, now in the background),
- a second start over that folder (what a restart pays before its compiled forward runs),
- the step: decodes at a context of `--context` tokens, p50 of `--steps` steps at each batch size.
The eager forward's steps are measured too: that is what a server serves while it compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.process.flags import add_model_flags, settings_from_args
from config.settings import Settings

SCOPES = ("model", "layer")


@dataclass(slots=True, frozen=True)
class StepWorkload:
    batches: tuple[int, ...]
    context: int
    steps: int


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("compile", help="compile time and step time of each compile scope, and eager")
    add_model_flags(parser)
    parser.add_argument("--scopes", default="model,layer", help="compile scopes to measure (model, layer)")
    parser.add_argument("--batches", default="1,8,32,64", help="decodes per step")
    parser.add_argument("--context", type=int, default=200, help="each decode's context, in tokens")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    parser.add_argument("--out", help="write the JSON report here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.compile_mode == "eager":
        print("fairlane bench compile: give a compiled mode (--compile default or max)", file=sys.stderr)
        return 2
    workload = StepWorkload(tuple(int(b) for b in args.batches.split(",")), args.context, args.steps)
    report: dict[str, Any] = {"model": settings.model, "compile_mode": settings.compile_mode,
                              "workload": {"batches": workload.batches, "context": workload.context,
                                           "steps": workload.steps},
                              "machine": machine_description(), "load_average_before": os.getloadavg()[0]}
    rows: dict[str, Any] = {"eager": run_child(settings, workload, "eager", None)}
    for scope in args.scopes.split(","):
        with tempfile.TemporaryDirectory(prefix="fairlane-bench-compile-") as folder:
            cold = run_child(settings, workload, scope, folder)
            warm = run_child(settings, workload, scope, folder, time_steps=False)
            rows[scope] = {**cold, "second_start_seconds": warm["compile_seconds"],
                           "second_start_graphs": warm["graphs"]}
    report["load_average_after"] = os.getloadavg()[0]
    report["results"] = rows
    print(format_table(rows, workload))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def machine_description() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return {}
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return {"cpu": model, "cpus": os.cpu_count(),
            "instruction_sets": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))}


def run_child(settings: Settings, workload: StepWorkload, scope: str, folder: str | None,
              time_steps: bool = True) -> dict[str, Any]:
    """One measurement in a process of its own: dynamo's in-memory caches would make a second compile in
    the same process look free."""
    command = [sys.executable, "-m", "benchmarks.bench_compile", settings.model_dump_json(), scope,
               folder or "", json.dumps(workload.batches), str(workload.context),
               str(workload.steps if time_steps else 0)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"the {scope} measurement failed:\n{finished.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(finished.stdout.strip().splitlines()[-1])
    return result


def measure(settings: Settings, scope: str, folder: str, workload: StepWorkload) -> dict[str, Any]:
    """In the child: build the runner (compiling, unless eager), then time decode steps."""
    from app.process.engine_factory import load_model_for
    from gpu.compiled import CompileConfig
    from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of

    loaded = load_model_for(settings)
    blocks_per_sequence = -(-(workload.context + 1) // settings.block_size)
    num_blocks = max(workload.batches) * blocks_per_sequence + 1
    budget = RunnerBudget(block_size=settings.block_size, swap_space_bytes=0, seed=settings.seed,
                          kv_cache_bytes=num_blocks * kv_shape_of(loaded, settings.block_size).bytes_per_block)
    mode = "eager" if scope == "eager" else settings.compile_mode
    compilation = CompileConfig(mode, folder or None, "layer" if scope == "layer" else "model")
    started = time.perf_counter()
    runner = ModelRunner(loaded, budget, compilation)
    built_seconds = time.perf_counter() - started
    result: dict[str, Any] = {"scope": scope, "compile_seconds": round(runner.forward.compile_seconds, 1),
                              "build_seconds": round(built_seconds, 1), "graphs": runner.forward.num_graphs,
                              "step_ms_p50": {}}
    for batch in workload.batches if workload.steps else ():
        result["step_ms_p50"][str(batch)] = round(time_decodes(runner, batch, workload, blocks_per_sequence), 2)
    result["recompilations"] = runner.forward.recompilations
    return result


def time_decodes(runner: Any, batch: int, workload: StepWorkload, blocks_per_sequence: int) -> float:
    from contract.plan import SamplingParams, ScheduledSequence

    sequences = [ScheduledSequence(f"s{i}", [7], workload.context,
                                   tuple(range(1 + i * blocks_per_sequence, 1 + (i + 1) * blocks_per_sequence)),
                                   True, SamplingParams()) for i in range(batch)]
    times = []
    for index in range(workload.steps + 3):  # three untimed: the first calls of a shape allocate
        started = time.perf_counter()
        runner.compute_logits(sequences)
        if index >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def format_table(rows: dict[str, Any], workload: StepWorkload) -> str:
    batches = " | ".join(f"{b} seq ms" for b in workload.batches)
    lines = [f"| forward | cold compile s | graphs | second start s | {batches} |",
             "|---|---|---|---|" + "---|" * len(workload.batches)]
    for name, row in rows.items():
        steps = " | ".join(f"{row['step_ms_p50'][str(b)]:.2f}" for b in workload.batches)
        if name == "eager":
            lines.append(f"| eager | - | - | - | {steps} |")
        else:
            lines.append(f"| {name} | {row['compile_seconds']:.1f} | {row['graphs']} | "
                         f"{row['second_start_seconds']:.1f} | {steps} |")
    return "\n".join(lines)


def child_main(argv: list[str]) -> int:
    settings_json, scope, folder, batches, context, steps = argv
    settings = Settings.model_validate_json(settings_json)
    workload = StepWorkload(tuple(json.loads(batches)), int(context), int(steps))
    print(json.dumps(measure(settings, scope, folder, workload)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
