"""`fairlane bench prefix`: requests sharing a long system prompt, with prefix caching off and on.

Every request is the same system prompt (default 1,000 tokens) followed by a short distinct
question. The same requests run on two fresh engines, caching off then on, each through a closed
loop of `--concurrency` clients. Reported: TTFT p50/p99 (all requests, and on cache hits only), the
hit rate (prompt tokens served from cache / prompt tokens), and output throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from app.process.engine_factory import build_engine
from app.process.flags import add_model_flags, settings_from_args
from benchmarks.bench_prefix_tiers import CONFIGURATIONS, run_tiers
from benchmarks.prefix_requests import Outcome, one_request
from config.settings import Settings
from loadtest.bench_output import format_table, write_report
from loadtest.stats import percentile_or_nan as percentile
from scheduling.engine import Engine


@dataclass(slots=True, frozen=True)
class PrefixWorkload:
    system_prompt: list[int]
    questions: list[list[int]]
    max_tokens: int


def make_prefix_workload(num_requests: int, system_len: int, seed: int, max_tokens: int) -> PrefixWorkload:
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    questions = [[rng.randrange(256) for _ in range(rng.randint(16, 48))] for _ in range(num_requests)]
    return PrefixWorkload(system, questions, max_tokens)


async def closed_loop(engine: Engine, workload: PrefixWorkload, concurrency: int) -> tuple[list[Outcome], float]:
    prompts = [workload.system_prompt + q for q in workload.questions]
    outcomes: list[Outcome | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def client() -> None:
        for i in next_index:
            outcomes[i] = await one_request(engine, f"p{i}", prompts[i], workload.max_tokens)

    await engine.start()
    await one_request(engine, "warmup", [1, 2, 3, 4], 2)  # first-call costs stay out of the clock
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await engine.shutdown()
    return [o for o in outcomes if o is not None], wall


def run_mode(settings: Settings, workload: PrefixWorkload, concurrency: int, caching: bool) -> dict[str, Any]:
    engine, _ = build_engine(settings.model_copy(update={"enable_prefix_caching": caching}))
    outcomes, wall = asyncio.run(closed_loop(engine, workload, concurrency))
    hits = [o.ttft for o in outcomes if o.num_cached_tokens > 0]
    all_ttft = [o.ttft for o in outcomes]
    prompt_tokens = sum(o.num_prompt_tokens for o in outcomes)
    return {
        "requests": len(outcomes),
        "ttft_p50_s": percentile(all_ttft, 50), "ttft_p99_s": percentile(all_ttft, 99),
        "hit_ttft_p50_s": percentile(hits, 50), "hit_ttft_p99_s": percentile(hits, 99),
        "hit_requests": len(hits),
        "hit_rate": sum(o.num_cached_tokens for o in outcomes) / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens_per_s": sum(o.num_output_tokens for o in outcomes) / wall,
        "requests_per_s": len(outcomes) / wall,
        "wall_s": wall,
        "ttft_mean_s": statistics.fmean(all_ttft),
    }


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    off, on = results["caching_off"], results["caching_on"]
    hit_p50 = on["hit_ttft_p50_s"] or float("inf")
    return {
        "ttft_p50_speedup_on_hits": off["ttft_p50_s"] / hit_p50,
        "ttft_p99_speedup_on_hits": off["ttft_p99_s"] / (on["hit_ttft_p99_s"] or float("inf")),
        "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
    }


def print_table(results: dict[str, dict[str, Any]], ratios: dict[str, Any]) -> None:
    rows = [["mode", "TTFT p50 ms", "TTFT p99 ms", "hit TTFT p50 ms", "hit TTFT p99 ms", "hit rate", "out tok/s"]]
    for mode, r in results.items():
        rows.append([mode, f"{r['ttft_p50_s'] * 1e3:.1f}", f"{r['ttft_p99_s'] * 1e3:.1f}",
                     f"{r['hit_ttft_p50_s'] * 1e3:.1f}", f"{r['hit_ttft_p99_s'] * 1e3:.1f}",
                     f"{r['hit_rate']:.3f}", f"{r['output_tokens_per_s']:.1f}"])
    print(format_table(rows))
    print(f"TTFT on cache hits vs caching off: p50 {ratios['ttft_p50_speedup_on_hits']:.1f}x lower, "
          f"p99 {ratios['ttft_p99_speedup_on_hits']:.1f}x lower; throughput {ratios['throughput_ratio']:.2f}x")


def run_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.tiers:
        return run_tiers(args, settings)
    workload = make_prefix_workload(args.requests, args.system_tokens or 1000, args.seed, args.max_tokens)
    results = {f"caching_{'on' if caching else 'off'}": run_mode(settings, workload, args.concurrency, caching)
               for caching in (False, True)}
    ratios = report(results)
    print_table(results, ratios)
    document = {"model": settings.model, "requests": args.requests, "system_tokens": args.system_tokens or 1000,
                "concurrency": args.concurrency, "max_tokens": args.max_tokens, "systems": results,
                "ratios": ratios}
    write_report(args.out, document)
    return 0


def tier_configs(text: str) -> tuple[str, ...]:
    configs = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown or not configs:
        raise argparse.ArgumentTypeError(f"configurations are some of {', '.join(CONFIGURATIONS)}; got {text!r}")
    return configs


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("prefix", help="shared system prompt: TTFT with prefix caching off and on; "
                                                  "--tiers: many tenants' prompts over the device, host and disk tiers")
    add_model_flags(parser)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int,
                        help="the system prompt's tokens (default 1,000; 2,000 with --tiers)")
    parser.add_argument("--tiers", action="store_true",
                        help="the tiered cache benchmark (benchmarks/bench_prefix_tiers.py)")
    parser.add_argument("--tenants", type=int, default=64, help="--tiers: tenants, a system prompt each")
    parser.add_argument("--rounds", type=int, default=2, help="--tiers: measured rounds of one request per tenant")
    parser.add_argument("--disk-dir", help="--tiers: where the disk tier's temporary folder goes (default: /tmp)")
    parser.add_argument("--configs", type=tier_configs, default=CONFIGURATIONS,
                        help="--tiers: which configurations, comma-separated, in order (default: "
                             f"{','.join(CONFIGURATIONS)})")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.set_defaults(handler=run_bench)
