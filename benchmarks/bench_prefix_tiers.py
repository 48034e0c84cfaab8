"""`fairlane bench prefix --tiers`: many tenants' long system prompts on a KV pool that holds a quarter of
them, with the prefix cache on the device only, then with a host tier, then with host and disk tiers;
and after a restart, each tenant's first request served from the disk tier.

Each of `--tenants` tenants (default 64) has its own system prompt (default 2,000 tokens) and asks short
questions (16-48 tokens), each request salted by its tenant as the server salts them. A first round
sends one request per tenant (every prefix is computed once), then `--rounds` more rounds send one per
tenant in a shuffled order, through `--concurrency` closed-loop clients; the warm rounds are measured:
hit rate (prompt tokens served from any tier / prompt tokens), TTFT p50/p99 and output tokens/s.

Sizes: the device pool holds a quarter of the prefixes; the host tier all of them (device + host), or a
quarter again with the disk holding all (device + host + disk). After the last configuration its engine
is shut down and a new one started on the same disk folder: one request per tenant then measures
`restart_ttft_p50_s`, against the cold first round of the first configuration run. `--configs` runs
some of the three (the restart needs the disk one; the ratios, device only and another).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from app.process.engine_factory import build_engine, load_model_for
from benchmarks.prefix_requests import Outcome, one_request
from config.settings import Settings
from gpu.runner import kv_shape_of
from loadtest.bench_output import format_table, write_report
from loadtest.stats import percentile_or_nan as percentile
from scheduling.engine import Engine


@dataclass(slots=True, frozen=True)
class TenantWorkload:
    systems: list[list[int]]  # one system prompt per tenant
    rounds: list[list[tuple[int, list[int]]]]  # per round: (tenant, question) in sending order
    max_tokens: int


def make_workload(num_tenants: int, system_len: int, num_rounds: int, max_tokens: int, seed: int) -> TenantWorkload:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(system_len)] for _ in range(num_tenants)]
    rounds = []
    for index in range(num_rounds + 2):  # the cold round, the measured rounds, the round after a restart
        order = list(range(num_tenants))
        if index:
            rng.shuffle(order)
        rounds.append([(tenant, [rng.randrange(256) for _ in range(rng.randint(16, 48))]) for tenant in order])
    return TenantWorkload(systems, rounds, max_tokens)


async def run_round(engine: Engine, workload: TenantWorkload, index: int, concurrency: int
                    ) -> tuple[list[Outcome], float]:
    sends = workload.rounds[index]
    outcomes: list[Outcome | None] = [None] * len(sends)
    next_index = iter(range(len(sends)))

    async def client() -> None:
        for i in next_index:
            tenant, question = sends[i]
            outcomes[i] = await one_request(engine, f"r{index}-{i}", workload.systems[tenant] + question,
                                            workload.max_tokens, cache_salt=f"tenant-{tenant}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [o for o in outcomes if o is not None], time.perf_counter() - started


def summary(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    prompt_tokens = sum(o.num_prompt_tokens for o in outcomes)
    ttfts = [o.ttft for o in outcomes]
    return {"requests": len(outcomes), "hit_rate": sum(o.num_cached_tokens for o in outcomes) / prompt_tokens,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "output_tokens_per_s": sum(o.num_output_tokens for o in outcomes) / wall, "wall_s": wall}


async def measure(engine: Engine, workload: TenantWorkload, num_rounds: int, concurrency: int
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cold round, then the measured ones; the engine is left running (see `restart`)."""
    await engine.start()
    cold, cold_wall = await run_round(engine, workload, 0, concurrency)
    warm: list[Outcome] = []
    wall = 0.0
    for index in range(1, num_rounds + 1):
        outcomes, seconds = await run_round(engine, workload, index, concurrency)
        warm += outcomes
        wall += seconds
    stats = engine.stats()["prefix_cache"]
    return {**summary(warm, wall), "tiers": stats["tiers"]}, summary(cold, cold_wall)


def tier_settings(settings: Settings, mode: str, prefix_bytes: int, num_tenants: int, folder: str) -> Settings:
    quarter = prefix_bytes * num_tenants // 4
    update: dict[str, Any] = {"kv_cache_bytes": quarter, "kv_host_cache_bytes": 0, "kv_disk_cache_path": None}
    if mode == "device+host":
        update["kv_host_cache_bytes"] = prefix_bytes * num_tenants * 5 // 4
    elif mode == "device+host+disk":
        update.update(kv_host_cache_bytes=quarter, kv_disk_cache_path=folder,
                      kv_disk_cache_bytes=prefix_bytes * num_tenants * 5 // 4)
    return settings.model_copy(update=update)


def run_mode(settings: Settings, workload: TenantWorkload, args: argparse.Namespace) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        engine, _ = build_engine(settings)
        warm, cold = await measure(engine, workload, args.rounds, args.concurrency)
        await engine.shutdown()
        return {"warm": warm, "cold_round": cold}
    return asyncio.run(go())


def run_restart(settings: Settings, workload: TenantWorkload, args: argparse.Namespace) -> dict[str, Any]:
    """A new engine on the last configuration's disk folder: one request per tenant, cold device and host."""
    async def go() -> dict[str, Any]:
        engine, _ = build_engine(settings)
        await engine.start()
        outcomes, wall = await run_round(engine, workload, len(workload.rounds) - 1, args.concurrency)
        await engine.shutdown()
        return summary(outcomes, wall)
    return asyncio.run(go())


CONFIGURATIONS = ("device", "device+host", "device+host+disk")


def print_table(results: dict[str, dict[str, Any]], restart: dict[str, Any] | None, ratios: dict[str, float]) -> None:
    rows = [["configuration", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "out tok/s"]]
    for mode, result in results.items():
        warm = result["warm"]
        rows.append([mode, f"{warm['hit_rate']:.3f}", f"{warm['ttft_p50_s'] * 1e3:.1f}",
                     f"{warm['ttft_p99_s'] * 1e3:.1f}", f"{warm['output_tokens_per_s']:.1f}"])
    cold = next(iter(results.values()))["cold_round"]
    rows.append(["cold first requests", f"{cold['hit_rate']:.3f}", f"{cold['ttft_p50_s'] * 1e3:.1f}",
                 f"{cold['ttft_p99_s'] * 1e3:.1f}", f"{cold['output_tokens_per_s']:.1f}"])
    if restart is not None:
        rows.append(["after a restart (disk)", f"{restart['hit_rate']:.3f}", f"{restart['ttft_p50_s'] * 1e3:.1f}",
                     f"{restart['ttft_p99_s'] * 1e3:.1f}", f"{restart['output_tokens_per_s']:.1f}"])
    print(format_table(rows))
    print(", ".join(f"{name} {value:.2f}x" for name, value in ratios.items()))


def tier_ratios(results: dict[str, dict[str, Any]], restart: dict[str, Any] | None) -> dict[str, float]:
    """TTFT p50 of each tier configuration against device only, and of the restart against cold; those that ran."""
    ratios = {}
    if "device" in results:
        device_p50 = results["device"]["warm"]["ttft_p50_s"]
        for mode, name in (("device+host", "host"), ("device+host+disk", "disk")):
            if mode in results:
                ratios[f"{name} TTFT p50 vs device only"] = device_p50 / results[mode]["warm"]["ttft_p50_s"]
    if restart is not None:
        cold = next(iter(results.values()))["cold_round"]
        ratios["restart first TTFT p50 vs cold"] = cold["ttft_p50_s"] / restart["ttft_p50_s"]
    return ratios


def run_tiers(args: argparse.Namespace, settings: Settings) -> int:
    system_tokens = args.system_tokens or 2000
    workload = make_workload(args.tenants, system_tokens, args.rounds, args.max_tokens, args.seed)
    shape = kv_shape_of(load_model_for(settings), settings.block_size)
    blocks_per_prefix = -(-(system_tokens + 48 + args.max_tokens) // settings.block_size)
    prefix_bytes = blocks_per_prefix * shape.bytes_per_block
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    restart = None
    with tempfile.TemporaryDirectory(prefix="fairlane-bench-tiers-", dir=args.disk_dir) as folder:
        for mode in args.configs:
            results[mode] = run_mode(tier_settings(settings, mode, prefix_bytes, args.tenants, folder), workload, args)
        if "device+host+disk" in results:
            restart = run_restart(tier_settings(settings, "device+host+disk", prefix_bytes, args.tenants, folder),
                                  workload, args)
    ratios = tier_ratios(results, restart)
    print_table(results, restart, ratios)
    document = {"model": settings.model, "tenants": args.tenants, "system_tokens": system_tokens,
                "rounds": args.rounds, "concurrency": args.concurrency, "block_size": settings.block_size,
                "bytes_per_block": shape.bytes_per_block, "configurations": results, "restart": restart,
                "ratios": ratios, "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    write_report(args.out, document)
    return 0
