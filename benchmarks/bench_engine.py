"""`fairlane bench engine`: one fixed offline workload on this engine and on two Hugging Face baselines.

Systems, each on a fresh model instance with the same weights, dtype and device:
- `fairlane`: the asyncio engine built from the settings, every request submitted at once;
- `hf_static`: `model.generate` in static batches, left-padded, greedy;
- `hf_continuous`: transformers' own continuous batching manager, given the same KV budget,
  token budget and sequence cap as the engine.

The baselines get the engine's compile mode (`--hf-compile same`, the default) where transformers
can compile: `generate` compiles its decode forward over a static cache, the continuous batching
manager its varlen and decode forwards, both through inductor with the engine's options. A compiled
baseline runs the whole workload once before the clock starts, so no compilation is timed; the
engine compiles at start-up.

Every request generates exactly its own output length (end-of-sequence never stops it), and only
those tokens count; a static batch runs to its longest member and the extra tokens are not counted.
By default each system runs in its own spawned process so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import multiprocessing
import os
import platform
import resource
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from app.process.engine_factory import build_engine, load_model_for
from app.process.flags import add_model_flags, settings_from_args
from benchmarks.common import (
    BenchRequest,
    MiB,
    SystemResult,
    WorkloadSpec,
    common_prefix_fraction,
    count_requested_tokens,
    exact_match_fraction,
    make_workload,
    peak_rss_bytes,
)
from config.settings import Settings
from gpu.compiled import INDUCTOR_OPTIONS, CompileMode
from gpu.runner import kv_shape_of
from loadtest.bench_output import format_table, write_report
from scheduling.request import Request, RequestId

SYSTEMS = ("fairlane", "hf_static", "hf_continuous")
PEERS = ("hf_static", "hf_continuous")
WARMUP = BenchRequest(list(range(16)), 4)  # one short request per system, before the clock starts


@dataclass(slots=True, frozen=True)
class EngineBenchOptions:
    settings: Settings  # model, dtype, device, KV budget and scheduling caps, shared by all systems
    workload: WorkloadSpec
    systems: tuple[str, ...]
    static_batch_size: int = 16
    isolate: bool = True  # one spawned process per system
    num_threads: int | None = None  # torch intra-op threads in each system; None keeps torch's default
    hf_compile: CompileMode = "eager"  # how the Hugging Face baselines run (inductor options as the engine's)


# ---- the systems ---------------------------------------------------------------------------------


def run_system(name: str, options: EngineBenchOptions) -> SystemResult:
    """Run one system on the whole workload, in this process."""
    import torch

    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
    workload = make_workload(options.workload)
    loaded = load_model_for(options.settings)  # a fresh instance: no system sees another's state
    if name == "fairlane":
        return _run_fairlane(options.settings, loaded, workload)
    if name == "hf_static":
        return _run_hf_static(loaded, workload, options.static_batch_size, options.hf_compile)
    if name == "hf_continuous":
        return _run_hf_continuous(options.settings, loaded, workload, options.hf_compile)
    raise ValueError(f"unknown system '{name}'; choose from {', '.join(SYSTEMS)}")


def _run_fairlane(settings: Settings, loaded: Any, workload: list[BenchRequest]) -> SystemResult:
    engine, _ = build_engine(settings, loaded)
    return asyncio.run(_drive_engine(engine, workload))


async def _drive_engine(engine: Any, workload: list[BenchRequest]) -> SystemResult:
    def request(request_id: str, req: BenchRequest) -> Request:
        return Request(RequestId(request_id), list(req.prompt_token_ids), req.num_output_tokens,
                       stop_token_ids=frozenset())

    await engine.start()
    try:
        await _drain(engine.submit(request("warmup", WARMUP)))
        forward_before, steps_before = engine.times.forward_seconds, engine.times.steps
        started = time.perf_counter()
        streams = [engine.submit(request(f"r{i}", req)) for i, req in enumerate(workload)]
        outputs = list(await asyncio.gather(*(_drain(stream) for stream in streams)))
        wall = time.perf_counter() - started
        stats = engine.stats()
    finally:
        await engine.shutdown()
    forward = engine.times.forward_seconds - forward_before
    extra = {"forward_seconds": forward, "forward_fraction": forward / wall,
             "steps": engine.times.steps - steps_before,
             **{key: stats[key] for key in ("preemptions", "swap") if key in stats}}
    return SystemResult("fairlane", wall, count_requested_tokens(outputs, workload), peak_rss_bytes(),
                        outputs, extra)


async def _drain(stream: Any) -> list[int]:
    tokens: list[int] = []
    async for event in stream:
        if event.error is not None:
            raise RuntimeError(f"request {event.request_id} failed: {event.error}")
        tokens.extend(event.new_token_ids)
    return tokens


def _pad_token_id(model: Any) -> int:
    for source in (model.generation_config, model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def _hf_compile_config(mode: CompileMode, *, dynamic: bool | None) -> Any:
    """transformers' CompileConfig with the engine's inductor options for the mode; None when eager."""
    from transformers import CompileConfig

    options = INDUCTOR_OPTIONS[mode]
    if options is None:
        return None
    config = CompileConfig(fullgraph=False, dynamic=dynamic, mode=None, options=dict(options))  # type: ignore[arg-type]
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told to
    return config


def _run_hf_static(loaded: Any, workload: list[BenchRequest], batch_size: int,
                   compile_mode: CompileMode = "eager") -> SystemResult:
    """Static batches through `generate`. Compiled, the decode forward runs over one static cache sized for
    the workload's longest request and reset between batches, so every full batch has the same shapes and
    inductor compiles it once."""
    import torch
    from transformers import StaticCache

    model, pad = loaded.model, _pad_token_id(loaded.model)
    model.generation_config.eos_token_id = None  # this instance is ours: no token ends a row early
    compile_config = _hf_compile_config(compile_mode, dynamic=None)
    cache = None
    if compile_config is not None:
        model.generation_config.compile_config = compile_config
        longest = max(len(r.prompt_token_ids) for r in workload) + max(r.num_output_tokens for r in workload)
        cache = StaticCache(config=model.config, max_cache_len=longest)

    def generate(batch: Sequence[BenchRequest]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
        with torch.inference_mode():
            if cache is not None:
                cache.reset()  # its tensors were made in inference mode: they change only there
            out = model.generate(
                input_ids=torch.tensor(ids, device=loaded.device),
                attention_mask=torch.tensor(mask, device=loaded.device), past_key_values=cache,
                max_new_tokens=max(r.num_output_tokens for r in batch), do_sample=False, pad_token_id=pad)
        new = out[:, width:].tolist()
        return [row[: r.num_output_tokens] for row, r in zip(new, batch, strict=True)]

    def generate_all() -> list[list[int]]:
        outputs: list[list[int]] = []
        for start in range(0, len(workload), batch_size):
            outputs.extend(generate(workload[start:start + batch_size]))
        return outputs

    warmup_seconds = _timed(generate_all if compile_config is not None else lambda: generate([WARMUP]))[1]
    outputs, wall = _timed(generate_all)
    return SystemResult("hf_static", wall, count_requested_tokens(outputs, workload), peak_rss_bytes(),
                        outputs, {"batch_size": batch_size, "compile": compile_mode, "warmup_seconds": warmup_seconds,
                                  "compiled_graphs": _compiled_graphs()})


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (0 for a baseline run eagerly)."""
    import torch._dynamo

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _timed(run: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = run()
    return result, time.perf_counter() - started


# A fixed KV budget rather than a share of free memory: HF's continuous batching gets the same bytes,
# and runs compare across machines.
BENCH_KV_CACHE_BYTES = 256 * MiB


def _run_hf_continuous(settings: Settings, loaded: Any, workload: list[BenchRequest],
                       compile_mode: CompileMode = "eager") -> SystemResult:
    """transformers' manager with the engine's budgets: its defaults would size the KV cache from free
    memory and build attention masks for 8192-token batches. It keeps its own page size (256 tokens),
    which runs faster on the CPU than the engine's 16-token blocks; the KV bytes are the same. Compiled,
    its varlen and decode forwards get the engine's inductor options with dynamic shapes, as its own
    default compile levels choose."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page_size = ContinuousBatchingConfig().page_size
    bytes_per_page = kv_shape_of(loaded, page_size).bytes_per_block
    compile_config = _hf_compile_config(compile_mode, dynamic=True)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=max(1, (settings.kv_cache_bytes or BENCH_KV_CACHE_BYTES) // bytes_per_page),
        max_batch_tokens=settings.max_num_batched_tokens, max_requests_per_batch=settings.max_num_seqs,
        allow_block_sharing=False, use_cuda_graph=False, seed=settings.seed,
        varlen_compile_config=compile_config, decode_compile_config=compile_config)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_token_id(loaded.model),
                                  max_new_tokens=max(r.num_output_tokens for r in workload))
    manager = loaded.model.init_continuous_batching(generation_config=gen_config,
                                                    continuous_batching_config=cb_config)
    warmup = ({f"w{i}": req for i, req in enumerate(workload)} if compile_config is not None
              else {"warmup": WARMUP})
    manager.start()
    try:
        warmup_seconds = _timed(lambda: _collect(manager, warmup))[1]
        results, wall = _timed(lambda: _collect(manager, {f"r{i}": req for i, req in enumerate(workload)}))
    finally:
        manager.stop(block=True)
        manager.destroy()
    outputs = [results[f"r{i}"] for i in range(len(workload))]
    return SystemResult("hf_continuous", wall, count_requested_tokens(outputs, workload), peak_rss_bytes(),
                        outputs, {"page_size": page_size, "num_blocks": cb_config.num_blocks,
                                  "compile": compile_mode, "warmup_seconds": warmup_seconds,
                                  "compiled_graphs": _compiled_graphs()})


def _collect(manager: Any, requests: dict[str, BenchRequest]) -> dict[str, list[int]]:
    for request_id, req in requests.items():
        manager.add_request(req.prompt_token_ids, request_id=request_id, max_new_tokens=req.num_output_tokens,
                            eos_token_id=-1)
    outputs: dict[str, list[int]] = {}
    while len(outputs) < len(requests):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching manager stopped before finishing the workload")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            outputs[result.request_id] = list(result.generated_tokens)
    return outputs


# ---- orchestration and the report ----------------------------------------------------------------


def _run_isolated(name: str, options: EngineBenchOptions) -> SystemResult:
    """Run one system in a fresh spawned process: its own heap, its own peak RSS."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_system, name, options).result()


def run_benchmark(options: EngineBenchOptions) -> dict[str, Any]:
    """Run the chosen systems one after another and build the JSON report."""
    load_before = os.getloadavg()  # a busy machine slows every system: the report says how busy
    results: dict[str, SystemResult] = {}
    for name in options.systems:
        results[name] = _run_isolated(name, options) if options.isolate else run_system(name, options)
    report = build_report(options, results)
    report["config"]["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return report


def build_report(options: EngineBenchOptions, results: dict[str, SystemResult]) -> dict[str, Any]:
    workload = make_workload(options.workload)
    ours = results.get("fairlane")
    compared = {peer: _compare(ours, results[peer], workload) for peer in PEERS
                if ours is not None and peer in results}
    ratios = {f"vs_{peer}": compared[peer].ratio if peer in compared else None for peer in PEERS}
    peak = max(peak_rss_bytes(), peak_rss_bytes(resource.RUSAGE_CHILDREN))
    return {
        "benchmark": "engine",
        "config": _config_section(options),
        "workload": {"num_requests": len(workload), "seed": options.workload.seed,
                     "prompt_len": list(options.workload.prompt_len), "output_len": list(options.workload.output_len),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
                     "output_tokens": sum(r.num_output_tokens for r in workload)},
        "systems": {name: result.to_json() for name, result in results.items()},
        "ratios": ratios,  # fairlane tokens/s over each peer's
        "forward_fraction": ours.extra["forward_fraction"] if ours is not None else None,
        "greedy_match": {peer: c.exact_match for peer, c in compared.items()},
        "greedy_common_prefix": {peer: c.common_prefix for peer, c in compared.items()},
        "peak_rss_mib": peak / MiB,  # this process or any system's process, whichever peaked higher
    }


@dataclass(slots=True, frozen=True)
class Comparison:
    ratio: float | None  # fairlane tokens/s over the peer's
    exact_match: float  # share of requests whose tokens equal fairlane's
    common_prefix: float  # mean share of a request's tokens before the first difference


def _compare(ours: SystemResult, theirs: SystemResult, workload: list[BenchRequest]) -> Comparison:
    ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else None
    return Comparison(ratio, exact_match_fraction(ours.output_token_ids, theirs.output_token_ids, workload),
                      common_prefix_fraction(ours.output_token_ids, theirs.output_token_ids, workload))


def _config_section(options: EngineBenchOptions) -> dict[str, Any]:
    s = options.settings
    return {"model": s.model, "dtype": s.dtype, "device": s.device, "block_size": s.block_size,
            "kv_cache_bytes": s.kv_cache_bytes, "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens, "static_batch_size": options.static_batch_size,
            "isolated_processes": options.isolate, "torch_threads": options.num_threads,
            "compile_mode": s.compile_mode, "hf_compile": options.hf_compile,
            "cpu_count": os.cpu_count(), "torch": importlib.metadata.version("torch"),
            "transformers": importlib.metadata.version("transformers"),
            "machine": platform.machine(), "python": platform.python_version()}


def render_table(report: dict[str, Any]) -> str:
    rows = [["system", "compile", "tokens", "wall s", "tokens/s", "fairlane x", "peak RSS MiB"]]
    ours = report["systems"].get("fairlane")
    for name, data in report["systems"].items():
        ratio = ours["tokens_per_s"] / data["tokens_per_s"] if ours and data["tokens_per_s"] else None
        compiled = report["config"]["compile_mode"] if name == "fairlane" else data.get("compile", "eager")
        rows.append([name, compiled, str(data["num_output_tokens"]), f"{data['wall_seconds']:.1f}",
                     f"{data['tokens_per_s']:.1f}", "-" if ratio is None else f"{ratio:.2f}",
                     f"{data['peak_rss_mib']:.0f}"])
    lines = [format_table(rows)]
    if report["forward_fraction"] is not None:
        lines.append(f"fairlane forward_fraction: {report['forward_fraction']:.3f}")
    return "\n".join(lines)


# ---- the command ---------------------------------------------------------------------------------


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("engine", help="tokens/s of this engine against HF generate and HF continuous "
                                                  "batching on one fixed workload")
    add_model_flags(parser)
    parser.set_defaults(model="builtin:small", dtype="float32", kv_cache_bytes=BENCH_KV_CACHE_BYTES,
                        handler=run_command)
    parser.add_argument("--requests", type=int, default=64, help="number of requests in the workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (lengths and prompt tokens)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--static-batch-size", type=int, default=16, help="batch size of hf_static")
    parser.add_argument("--prompt-len", type=_length_range, default="16:256",
                        help="prompt length range MIN:MAX (inclusive)")
    parser.add_argument("--output-len", type=_length_range, default="16:256",
                        help="output length range MIN:MAX (inclusive)")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads in every system (default: torch's own choice)")
    parser.add_argument("--hf-compile", choices=["same", *INDUCTOR_OPTIONS], default="same",
                        help="how the Hugging Face baselines run: 'same' compiles them with the engine's --compile "
                             "mode (their whole workload runs once untimed first); or a mode of their own")
    parser.add_argument("--in-process", action="store_true",
                        help="run every system in this process (faster start; RSS is then cumulative)")
    parser.add_argument("--out", help="write the JSON report here")


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"'{text}' is not a length range MIN:MAX with 1 <= MIN <= MAX")
    return bounds


def options_from_args(args: argparse.Namespace) -> EngineBenchOptions:
    systems = tuple(name.strip() for name in args.systems.split(",") if name.strip())
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"fairlane bench engine: unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    spec = WorkloadSpec(args.requests, args.seed, args.prompt_len, args.output_len)
    settings = settings_from_args(args)
    hf_compile = settings.compile_mode if args.hf_compile == "same" else args.hf_compile
    return EngineBenchOptions(settings, spec, systems, args.static_batch_size,
                              isolate=not args.in_process, num_threads=args.threads, hf_compile=hf_compile)


def run_command(args: argparse.Namespace) -> int:
    report = run_benchmark(options_from_args(args))
    print(render_table(report))
    write_report(args.out, report)
    return 0
