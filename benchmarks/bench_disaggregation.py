"""`fairlane bench cluster --disaggregated`: prefill and decode on different replicas against both on each.

Interactive chat streams (closed loops) beside an open-loop stream of long-prompt requests (about
`--long-words` words, some 2,000 tokens on the default model), on two replicas of `--replica-threads`
thread each: colocated (`--replicas 2`, the router spreading both kinds over both) against one prefill
and one decode replica (cluster/handoff.py). Each layout runs on a fresh cluster, one after the other,
the same seeded requests. Reported per layout: the chat streams' ITL and TTFT p50/p99, the long
prompts' TTFT, output tokens/s over the run, and the hand-off's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from config.settings import Settings
from loadtest.bench_output import format_table
from loadtest.client import OK, RequestRecord, send_chat
from loadtest.stats import percentile_or_nan
from loadtest.workload import INTERACTIVE, ChatRequest, LoadTenant, prompt_text

LAYOUTS: dict[str, dict[str, int]] = {"colocated": {"replicas": 2},
                                      "disaggregated": {"prefill_replicas": 1, "decode_replicas": 1}}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disaggregated", action="store_true",
                        help="compare one prefill + one decode replica against two colocated replicas (and nothing "
                             "else)")
    parser.add_argument("--duration-s", type=float, default=60.0, help="disaggregated: the measured run per layout")
    parser.add_argument("--chat-streams", type=int, default=2, help="disaggregated: closed-loop chat streams")
    parser.add_argument("--chat-words", type=int, default=40)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--long-words", type=int, default=1500, help="disaggregated: words of each long prompt")
    parser.add_argument("--long-tokens", type=int, default=16)
    parser.add_argument("--long-every-s", type=float, default=6.0, help="disaggregated: a long prompt this often")
    parser.add_argument("--replica-threads", type=int, default=1, help="torch threads of each replica")


async def timed(http: httpx.AsyncClient, model: str, request: ChatRequest, label: str) -> RequestRecord:
    record = RequestRecord(request.tenant.tenant_id, label, time.perf_counter())
    await send_chat(http, model, request, record, time.perf_counter)
    return record


def disaggregation_work(args: argparse.Namespace, tenant: LoadTenant
                        ) -> Callable[[str], Coroutine[Any, Any, dict[str, Any]]]:
    async def work(base_url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            warm = random.Random("warm-up")
            for words in (args.chat_words, args.long_words):  # each kind of step once before the clock runs
                await timed(http, args.model, ChatRequest(tenant, INTERACTIVE, (("user", prompt_text(warm, words)),),
                                                          4), "warm-up")
            records: list[RequestRecord] = []
            started = time.perf_counter()
            deadline = started + args.duration_s

            async def chat_loop(index: int) -> None:
                rng = random.Random(f"chat/{index}/{args.seed}")
                while time.perf_counter() < deadline:
                    text = prompt_text(rng, args.chat_words)
                    request = ChatRequest(tenant, INTERACTIVE, (("user", text),), args.chat_tokens)
                    records.append(await timed(http, args.model, request, "chat"))

            async def long_prompts() -> None:
                rng = random.Random(f"long/{args.seed}")
                sent: list[asyncio.Task[RequestRecord]] = []
                while time.perf_counter() < deadline:
                    request = ChatRequest(tenant, INTERACTIVE, (("user", prompt_text(rng, args.long_words)),),
                                          args.long_tokens)
                    sent.append(asyncio.create_task(timed(http, args.model, request, "long")))
                    await asyncio.sleep(args.long_every_s)
                records.extend(await asyncio.gather(*sent))

            await asyncio.gather(*(chat_loop(i) for i in range(args.chat_streams)), long_prompts())
            wall = time.perf_counter() - started
            stats = (await http.get("/stats", headers={"authorization": f"Bearer {args.admin_key}"})).json()
        return summarize(records, wall, stats)

    return work


def summarize(records: list[RequestRecord], wall_s: float, stats: dict[str, Any]) -> dict[str, Any]:
    chats = [r for r in records if r.klass == "chat" and r.outcome == OK]
    longs = [r for r in records if r.klass == "long" and r.outcome == OK]
    gaps = [later - earlier for r in chats for earlier, later in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    chat_ttfts = [r.ttft_s for r in chats if r.ttft_s is not None]
    long_ttfts = [r.ttft_s for r in longs if r.ttft_s is not None]
    replicas = stats.get("replicas", {}).values()
    return {
        "chat_itl_p50_s": percentile_or_nan(gaps, 50), "chat_itl_p99_s": percentile_or_nan(gaps, 99),
        "chat_ttft_p50_s": percentile_or_nan(chat_ttfts, 50), "chat_ttft_p99_s": percentile_or_nan(chat_ttfts, 99),
        "long_ttft_p50_s": percentile_or_nan(long_ttfts, 50), "long_ttft_p99_s": percentile_or_nan(long_ttfts, 99),
        "output_tokens_per_s": sum(r.completion_tokens for r in chats + longs) / wall_s,
        "chats": len(chats), "long_prompts": len(longs),
        "long_prompt_tokens_mean": sum(r.prompt_tokens for r in longs) / max(1, len(longs)),
        "failed": sum(r.outcome != OK for r in records), "wall_s": wall_s,
        "handoff": {r.get("role", "?"): r.get("handoff", {}) for r in replicas},
    }


def run_disaggregation(args: argparse.Namespace, base: Settings,
                       on_cluster: Callable[[Settings, Callable[[str], Coroutine[Any, Any, dict[str, Any]]]],
                                            dict[str, Any]],
                       tenant: LoadTenant) -> dict[str, Any]:
    results = {}
    for name, layout in LAYOUTS.items():
        settings = base.model_copy(update={**layout, "torch_threads": args.replica_threads})
        results[name] = on_cluster(settings, disaggregation_work(args, tenant))
        print(name, {k: v for k, v in results[name].items() if k != "handoff"}, flush=True)
    colocated, disaggregated = results["colocated"], results["disaggregated"]
    results["ratios"] = {key: disaggregated[key] / colocated[key] if colocated[key] else float("nan")
                         for key in ("chat_itl_p50_s", "chat_itl_p99_s", "chat_ttft_p50_s", "chat_ttft_p99_s",
                                     "long_ttft_p50_s", "long_ttft_p99_s", "output_tokens_per_s")}
    return results


def print_disaggregation(results: dict[str, Any]) -> None:
    keys = ("chat_itl_p50_s", "chat_itl_p99_s", "chat_ttft_p50_s", "chat_ttft_p99_s", "long_ttft_p50_s",
            "long_ttft_p99_s", "output_tokens_per_s")
    rows = [["", *keys]]
    for name in LAYOUTS:
        rows.append([name, *(f"{results[name][key]:.3f}" for key in keys)])
    rows.append(["disaggregated / colocated", *(f"{results['ratios'][key]:.2f}" for key in keys)])
    print(format_table(rows))
