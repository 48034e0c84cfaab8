"""`fairlane bench lora`: one workload on the base model, on one LoRA adapter, and spread over 4 and 16 adapters
of rank 8 and 64, in one run: output tokens/s and TTFT per mode, and JSON.

The adapters are made at run time with `peft` on the chosen model (random A and B, a fixed seed) and saved
to a temporary folder. Each mode runs on a fresh engine with as many slots as it has adapters, padded to
its rank; request i of an adapter mode runs on adapter i mod n, so every step mixes adapters. The base
model is measured twice: on an engine without LoRA (`base`), and on one with a LoRA slot that no request
uses (`base_lora_engine`), which is what the slot mask costs by itself. Each slot geometry is a graph of
its own for the compiled forward: a first run compiles one per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.process.engine_factory import build_engine
from app.process.flags import add_model_flags, settings_from_args
from benchmarks.common import BenchRequest, WorkloadSpec, make_workload
from config.settings import Settings
from contract.plan import LoraRef
from gpu.lora import TARGET_PROJECTIONS
from gpu.models import load_model
from loadtest.bench_output import format_table, write_report
from loadtest.stats import percentile_or_nan as percentile
from scheduling.engine import Engine
from scheduling.request import Request, RequestId


@dataclass(slots=True, frozen=True)
class LoraMode:
    name: str
    num_adapters: int  # 0: the base model
    rank: int
    lora_engine: bool  # whether the engine has LoRA slots (eager forward)


MODES = (LoraMode("base", 0, 8, False), LoraMode("base_lora_engine", 0, 8, True),
         LoraMode("lora1_r8", 1, 8, True), LoraMode("lora4_r8", 4, 8, True), LoraMode("lora16_r8", 16, 8, True),
         LoraMode("lora4_r64", 4, 64, True), LoraMode("lora16_r64", 16, 64, True))


def make_adapters(settings: Settings, root: Path, count: int, rank: int, seed: int) -> list[LoraRef]:
    """`count` adapters of this rank on every target projection, as peft saves them, random A and B."""
    from peft import LoraConfig, get_peft_model

    base = load_model(settings.model, device="cpu", dtype="float32", quantization="none",
                      cache_dir=settings.model_cache_dir).model
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_PROJECTIONS),
                                                 init_lora_weights=False))
    refs = []
    for index in range(count):  # one peft model, its pairs drawn again for each adapter
        generator = torch.Generator().manual_seed(seed + 1000 * rank + index)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        folder = root / f"r{rank}-{index}"
        peft_model.save_pretrained(str(folder))
        refs.append(LoraRef(folder.name, str(folder), 1))
    return refs


@dataclass(slots=True, frozen=True)
class Outcome:
    ttft: float
    num_output_tokens: int


async def one_request(engine: Engine, request: Request) -> Outcome:
    started = time.perf_counter()
    ttft = 0.0
    num_output = 0
    async for event in engine.submit(request):
        if not ttft:
            ttft = time.perf_counter() - started
        num_output = event.num_output_tokens
    return Outcome(ttft, num_output)


async def run_workload(engine: Engine, workload: list[BenchRequest], adapters: list[LoraRef]
                       ) -> tuple[list[Outcome], float]:
    """Every request at once (the engine's max_num_seqs bounds what runs); the wall time of the whole."""
    await engine.start()
    # First-call costs, and reading each adapter's folder, stay out of the clock.
    warmups = [Request(RequestId(f"warmup-{i}"), [1, 2, 3, 4], 2, adapter=adapter)
               for i, adapter in enumerate(adapters or [None])]
    await asyncio.gather(*(one_request(engine, r) for r in warmups))
    requests = [Request(RequestId(f"r{i}"), item.prompt_token_ids, item.num_output_tokens,
                        adapter=adapters[i % len(adapters)] if adapters else None)
                for i, item in enumerate(workload)]
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one_request(engine, r) for r in requests))
    wall = time.perf_counter() - started
    await engine.shutdown()
    return list(outcomes), wall


def run_mode(settings: Settings, mode: LoraMode, workload: list[BenchRequest], adapters: list[LoraRef]
             ) -> dict[str, Any]:
    lora = {"enable_lora": mode.lora_engine, "max_lora_rank": mode.rank,
            "max_loras": max(1, mode.num_adapters), "max_cpu_loras": max(1, mode.num_adapters)}
    engine, _ = build_engine(settings.model_copy(update=lora))
    outcomes, wall = asyncio.run(run_workload(engine, workload, adapters))
    ttfts = [o.ttft for o in outcomes]
    return {"adapters": mode.num_adapters, "rank": mode.rank if mode.num_adapters else None,
            "eager": settings.compile_mode == "eager", "requests": len(outcomes),
            "output_tokens_per_s": sum(o.num_output_tokens for o in outcomes) / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    base = results["base"]["output_tokens_per_s"]
    rows = [["mode", "adapters", "rank", "out tok/s", "vs base", "TTFT p50 ms", "TTFT p99 ms"]]
    for mode, r in results.items():
        rows.append([mode, str(r["adapters"]), str(r["rank"] or "-"), f"{r['output_tokens_per_s']:.1f}",
                     f"{r['output_tokens_per_s'] / base:.2f}x", f"{r['ttft_p50_s'] * 1e3:.1f}",
                     f"{r['ttft_p99_s'] * 1e3:.1f}"])
    print(format_table(rows))


def run_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    spec = WorkloadSpec(args.requests, args.seed, (args.prompt_min, args.prompt_max),
                        (args.output_min, args.output_max))
    workload = make_workload(spec)
    chosen = args.modes.split(",") if args.modes else [m.name for m in MODES]
    modes = [m for m in MODES if m.name == "base" or m.name in chosen]  # the base: what the rest compare with
    load_before = os.getloadavg()  # a busy machine slows every mode: the report says how busy
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fairlane-bench-lora-") as folder:
        most_per_rank: dict[int, int] = {}  # per rank, the most adapters any mode uses: made once
        for mode in modes:
            most_per_rank[mode.rank] = max(most_per_rank.get(mode.rank, 0), mode.num_adapters)
        made = {rank: make_adapters(settings, Path(folder), count, rank, args.seed)
                for rank, count in most_per_rank.items()}
        for mode in modes:
            adapters = made[mode.rank][:mode.num_adapters] if mode.num_adapters else []
            results[mode.name] = run_mode(settings, mode, workload, adapters)
    print_table(results)
    document = {"model": settings.model, "compile_mode": settings.compile_mode, "requests": args.requests,
                "seed": args.seed, "modes": results,
                "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    write_report(args.out, document)
    return 0


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("lora", help="tokens/s and TTFT on the base model and on 1, 4 and 16 LoRA "
                                                "adapters of rank 8 and 64")
    add_model_flags(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", help="a comma list of modes to run (default: all; 'base' always runs): "
                                        + ",".join(m.name for m in MODES))
    parser.add_argument("--out", help="write the results as JSON here")
    parser.set_defaults(handler=run_bench)
