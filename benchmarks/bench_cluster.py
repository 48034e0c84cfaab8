"""`fairlane bench cluster`: replicas on Ray Serve, through the OpenAI API on loopback.

Three questions, each on fresh local clusters of `--model` (default builtin:tiny):
- routing: a shared-prefix workload (each tenant its own long system prompt, short distinct
  questions) through our prefix- and load-aware router, Ray Serve's default power-of-two-choices
  router and its PrefixCacheAffinityRouter: the replicas' prefix-cache hit rate and TTFT.
- fairness: one tenant floods both replicas while two others each mostly keep to one replica (their
  prompts share a prefix, so the router keeps them where it is cached). Every tenant keeps more
  requests in flight than all the replicas' slots, so each stays backlogged for the whole measured
  window; Jain's index over the VTC service each got inside that window, with counters shared across
  replicas against per-replica counters. (VTC's fairness is defined among backlogged tenants: a
  tenant that gets all it asks for says nothing about the scheduler.)
- throughput: the same closed-loop workload on 2 replicas and on 1.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from app.process.flags import add_model_flags, settings_from_args
from benchmarks.bench_disaggregation import add_flags as add_disaggregation_flags
from benchmarks.bench_disaggregation import print_disaggregation, run_disaggregation
from config.settings import Settings
from loadtest.bench_output import format_table, write_report
from loadtest.stats import jain_index, percentile_or_nan
from loadtest.workload import LoadTenant
from tenancy.tenants import hash_api_key

ADMIN_KEY = "fl-bench-admin"
ROUTERS = ("prefix_load", "pow2", "prefix_affinity")
FAIRNESS_TENANTS = ("flood", "b", "c")
PARTS = ("routing", "fairness", "throughput")
CACHED_WEIGHT = 0.1  # settings.cached_token_weight's default: the service of a cached prompt token


@dataclass(slots=True, frozen=True)
class Answer:
    tenant: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    first_token_at: float  # perf_counter() time of the first content chunk (ended_at when none came)
    ended_at: float


def key_of(tenant: str) -> str:
    return f"fl-bench-{tenant}"


def tenants_toml(tenants: list[str]) -> str:
    entries = "".join(f'[[tenants]]\nid = "{t}"\napi_key_hashes = ["{hash_api_key(key_of(t))}"]\n\n' for t in tenants)
    return f'[admin]\napi_key_hashes = ["{hash_api_key(ADMIN_KEY)}"]\n\n{entries}'


def text(rng: random.Random, length: int) -> str:
    """Printable ASCII: one token per character on the builtin byte tokenizer."""
    return "".join(chr(rng.randrange(33, 127)) for _ in range(length))


async def sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    pending = b""
    async for piece in response.aiter_bytes():
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            yield line


async def stream_once(http: httpx.AsyncClient, model: str, tenant: str, prompt: str, max_tokens: int) -> Answer:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft = 0.0
    usage: dict[str, Any] = {}
    async with http.stream("POST", "/v1/completions", json=body,
                           headers={"authorization": f"Bearer {key_of(tenant)}"}) as response:
        response.raise_for_status()
        # Split on the SSE newline only: generated text may hold U+2028 or U+0085, which JSON leaves
        # unescaped and a text line splitter would break the event at.
        async for line in sse_lines(response):
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if not ttft and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    ended = time.perf_counter()
    return Answer(tenant, ttft, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0)),
                  int(usage.get("completion_tokens", 0)), started + ttft if ttft else ended, ended)


async def closed_loop(jobs: list[tuple[str, str]], concurrency: int, max_tokens: int, base_url: str, model: str
                      ) -> tuple[list[Answer], float]:
    """Run (tenant, prompt) jobs in order through `concurrency` clients."""
    answers: list[Answer] = []
    pending = iter(jobs)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def client() -> None:
            for tenant, prompt in pending:
                answers.append(await stream_once(http, model, tenant, prompt, max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers, time.perf_counter() - started


def replica_stats(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/stats", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


def on_cluster(settings: Settings, work: Callable[[str], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Start a cluster, run the work against its URL, stop it."""
    from cluster.launch import start_cluster  # imports Ray: only for this benchmark

    started = time.perf_counter()
    cluster = start_cluster(settings)
    start_s = time.perf_counter() - started
    try:
        return {**asyncio.run(work(cluster.url)), "cluster_start_s": start_s}
    finally:
        cluster.stop()


def prefix_jobs(args: argparse.Namespace) -> list[tuple[str, str]]:
    rng = random.Random(args.seed)
    systems = {f"t{i}": text(rng, args.system_tokens) for i in range(args.prefix_tenants)}
    return [(tenant, systems[tenant] + text(rng, rng.randint(16, 48)))
            for tenant in (rng.choice(list(systems)) for _ in range(args.requests))]


def routing_work(args: argparse.Namespace) -> Callable[[str], Coroutine[Any, Any, dict[str, Any]]]:
    async def work(base_url: str) -> dict[str, Any]:
        before = replica_stats(base_url)["prefix_cache"]
        answers, wall = await closed_loop(prefix_jobs(args), args.concurrency, args.max_tokens, base_url, args.model)
        after = replica_stats(base_url)["prefix_cache"]
        queried = after["queried_tokens"] - before["queried_tokens"]
        ttfts = [a.ttft_s for a in answers]
        return {"requests": len(answers), "hit_rate": (after["hit_tokens"] - before["hit_tokens"]) / max(1, queried),
                "ttft_p50_s": percentile_or_nan(ttfts, 50), "ttft_p99_s": percentile_or_nan(ttfts, 99),
                "wall_s": wall}

    return work


@dataclass(slots=True, frozen=True)
class Window:
    start: float  # perf_counter() seconds
    end: float


def vtc_service(answer: Answer, decode_weight: float, prompt_weight: float) -> float:
    computed = answer.prompt_tokens - answer.cached_tokens
    return prompt_weight * (computed + CACHED_WEIGHT * answer.cached_tokens) + decode_weight * answer.output_tokens


def service_in_window(answer: Answer, window: Window, decode_weight: float, prompt_weight: float) -> float:
    """The part of an answer's VTC service given inside the window: its prompt's at the first token
    (prefill is done by then), its output tokens' spread evenly from the first token to the last."""
    prompt = vtc_service(answer, 0.0, prompt_weight)
    decode = vtc_service(answer, decode_weight, prompt_weight) - prompt
    inside = prompt if window.start <= answer.first_token_at <= window.end else 0.0
    span = answer.ended_at - answer.first_token_at
    if span <= 0:
        return inside + (decode if window.start <= answer.ended_at <= window.end else 0.0)
    overlap = min(answer.ended_at, window.end) - max(answer.first_token_at, window.start)
    return inside + decode * max(0.0, overlap) / span


def fairness_prompts(tenant: str, prefix: str, system_tokens: int, rng: random.Random) -> Iterator[tuple[str, str]]:
    """Endless: a backlogged tenant must never run out of work before the window ends."""
    while True:
        yield tenant, prefix + text(rng, 32 if prefix else system_tokens + 32)


async def backlogged(http: httpx.AsyncClient, model: str, jobs: Iterator[tuple[str, str]], in_flight: int,
                     max_tokens: int, stop_at: float) -> list[Answer]:
    """Keep `in_flight` requests outstanding until `stop_at`, then let those in flight finish."""
    answers: list[Answer] = []

    async def client() -> None:
        while time.perf_counter() < stop_at:
            tenant, prompt = next(jobs)
            answers.append(await stream_once(http, model, tenant, prompt, max_tokens))

    await asyncio.gather(*(client() for _ in range(in_flight)))
    return answers


def waiting_by_tenant(metrics_text: str) -> dict[str, float]:
    """Requests waiting per tenant, all replicas and classes together, from the Prometheus text."""
    waiting: dict[str, float] = defaultdict(float)
    for line in metrics_text.splitlines():
        if line.startswith("fairlane:tenant_requests_waiting{") and 'tenant="' in line:
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            waiting[tenant] += float(line.rsplit(" ", 1)[1])
    return waiting


async def sample_backlog(http: httpx.AsyncClient, window: Window, every_s: float) -> list[dict[str, float]]:
    """Sample the replicas' waiting queues through the window: the check that every tenant stayed
    backlogged (the replicas' gauges are as of their latest report)."""
    samples: list[dict[str, float]] = []
    await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
    while time.perf_counter() < window.end:
        response = await http.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        if response.status_code == 200:
            samples.append(waiting_by_tenant(response.text))
        await asyncio.sleep(every_s)
    return samples


def fairness_result(answers: list[Answer], window: Window, samples: list[dict[str, float]], settings: Settings
                    ) -> dict[str, Any]:
    service: dict[str, float] = defaultdict(float)
    for answer in answers:
        service[answer.tenant] += service_in_window(answer, window, settings.vtc_decode_weight,
                                                    settings.vtc_prompt_weight)
    backlogged_share = {t: sum(1 for s in samples if s.get(t, 0.0) > 0) / len(samples) if samples else None
                        for t in FAIRNESS_TENANTS}
    return {"service": {t: service[t] for t in FAIRNESS_TENANTS},
            "jain_index": jain_index([service[t] for t in FAIRNESS_TENANTS]),
            "window_s": window.end - window.start, "backlog_samples": len(samples),
            "backlogged_share": backlogged_share,
            "requests_in_window": {t: sum(1 for a in answers if a.tenant == t
                                          and window.start <= a.ended_at <= window.end) for t in FAIRNESS_TENANTS}}


def fairness_work(args: argparse.Namespace, settings: Settings) -> Callable[[str], Coroutine[Any, Any, dict[str, Any]]]:
    """Every tenant keeps `--fairness-in-flight` requests outstanding (the flood twice that), more than
    all the replicas' slots, and never runs out of prompts, so each stays backlogged; service counts
    inside a fixed window after a warm-up, while all of them are still sending."""
    rng = random.Random(args.seed + 1)
    prefixes = {"flood": "", **{t: text(rng, args.system_tokens) for t in ("b", "c")}}

    async def work(base_url: str) -> dict[str, Any]:
        started = time.perf_counter()
        window = Window(started + args.fairness_warmup_s, started + args.fairness_warmup_s + args.fairness_window_s)
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            runs = [backlogged(http, args.model, fairness_prompts(t, prefixes[t], args.system_tokens, rng),
                               args.fairness_in_flight * (2 if t == "flood" else 1), args.max_tokens, window.end)
                    for t in FAIRNESS_TENANTS]
            sampling = asyncio.create_task(sample_backlog(http, window, 0.5))
            results = await asyncio.gather(*runs)
            samples = await sampling
        return fairness_result([a for answers in results for a in answers], window, samples, settings)

    return work


def throughput_work(args: argparse.Namespace) -> Callable[[str], Coroutine[Any, Any, dict[str, Any]]]:
    rng = random.Random(args.seed + 2)
    jobs = [("t0", text(rng, 64)) for _ in range(args.requests)]

    async def work(base_url: str) -> dict[str, Any]:
        answers, wall = await closed_loop(jobs, args.concurrency * 2, args.max_tokens * 4, base_url, args.model)
        return {"output_tokens_per_s": sum(a.output_tokens for a in answers) / wall, "wall_s": wall}

    return work


def run_routing(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    return {router: on_cluster(settings.model_copy(update={"cluster_router": router}), routing_work(args))
            for router in ROUTERS}


def run_fairness(args: argparse.Namespace, settings: Settings, base: Settings) -> dict[str, Any]:
    fair_settings = settings.model_copy(update={"max_num_seqs": args.fairness_max_num_seqs})
    return {f"{'shared' if shared else 'per_replica'}_counters":
            on_cluster(fair_settings.model_copy(update={"share_vtc": shared}), fairness_work(args, base))
            for shared in (True, False)}


def run_throughput(args: argparse.Namespace, common: dict[str, Any], base: Settings) -> dict[str, Any]:
    return {f"{n}_replicas": on_cluster(base.model_copy(update={**common, "replicas": n}), throughput_work(args))
            for n in (2, 1)}


def run_bench(args: argparse.Namespace) -> int:
    base = settings_from_args(args)
    args.model = base.served_model_name or base.model
    if args.fairness_in_flight is None:  # above all the slots: backlogged wherever the router sends it
        args.fairness_in_flight = args.fairness_max_num_seqs * 2
    folder = Path(tempfile.mkdtemp(prefix="fairlane-bench-cluster-"))
    tenants = folder / "tenants.toml"
    tenants.write_text(tenants_toml([*(f"t{i}" for i in range(args.prefix_tenants)), *FAIRNESS_TENANTS]))
    common = {"tenants_file": str(tenants), "port": args.port, "batch_db_path": str(folder / "batch.db"),
              "kv_handoff_path": str(folder / "kv-handoff")}
    if args.disaggregated:
        args.admin_key = ADMIN_KEY
        disaggregation = run_disaggregation(args, base.model_copy(update=common), on_cluster,
                                            LoadTenant("t0", key_of("t0")))
        print_disaggregation(disaggregation)
        write_report(args.out, {"model": base.model, "disaggregation": disaggregation,
                                "args": {k: v for k, v in vars(args).items() if k != "handler"}})
        return 0
    settings = base.model_copy(update={**common, "replicas": 2})
    results: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        if part not in args.parts:
            continue
        if part == "routing":
            results[part] = run_routing(args, settings)
        elif part == "fairness":
            results[part] = run_fairness(args, settings, base)
        else:
            results[part] = run_throughput(args, common, base)
        print(orjson.dumps(results[part]).decode(), flush=True)  # each part as it ends: a run takes minutes
    print_tables(results)
    write_report(args.out, {"model": base.model, **results,
                            "args": {k: v for k, v in vars(args).items() if k != "handler"}})
    return 0


def print_tables(results: dict[str, dict[str, Any]]) -> None:
    if routing := results.get("routing"):
        rows = [["router", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "wall s"]]
        rows += [[name, f"{r['hit_rate']:.3f}", f"{r['ttft_p50_s'] * 1e3:.1f}", f"{r['ttft_p99_s'] * 1e3:.1f}",
                  f"{r['wall_s']:.1f}"] for name, r in routing.items()]
        print(format_table(rows))
    if fairness := results.get("fairness"):
        rows = [["VTC counters", "Jain", *(f"{t} service" for t in FAIRNESS_TENANTS)]]
        rows += [[name, f"{r['jain_index']:.3f}", *(f"{r['service'].get(t, 0.0):.0f}" for t in FAIRNESS_TENANTS)]
                 for name, r in fairness.items()]
        print(format_table(rows))
    if throughput := results.get("throughput"):
        rows = [["replicas", "out tok/s", "wall s"]]
        rows += [[name, f"{r['output_tokens_per_s']:.1f}", f"{r['wall_s']:.1f}"] for name, r in throughput.items()]
        print(format_table(rows))


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("cluster", help="replicas on Ray Serve: routers, shared fairness, 2 vs 1 replica")
    add_model_flags(parser)
    parser.add_argument("--port", type=int, default=8471, help="Serve's HTTP port on 127.0.0.1")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prefix-tenants", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    parser.add_argument("--fairness-in-flight", type=int, default=None,
                        help="requests each tenant keeps outstanding (the flood twice that); default all the "
                             "replicas' slots, fairness-max-num-seqs x 2")
    parser.add_argument("--fairness-warmup-s", type=float, default=5.0, help="load before the measured window")
    parser.add_argument("--fairness-window-s", type=float, default=30.0, help="the measured window")
    parser.add_argument("--fairness-max-num-seqs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    add_disaggregation_flags(parser)
    parser.set_defaults(handler=run_bench)
