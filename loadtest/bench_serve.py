"""`fairlane bench serve`: streamed chat throughput and latency of any OpenAI-compatible server.

HTTP only, so the same command measures fairlane and, say, llama.cpp's llama-server with the same
requests: seeded prompts of about --prompt-tokens tokens, each with its own first words (no prefix
cache hits across requests), `ignore_eos` so every request generates exactly --max-tokens tokens.
Per concurrency level: N requests with c in flight at a time, after --warmup unmeasured ones;
output tokens/s over the level's wall time, TTFT, ITL (gaps between content chunks) and E2E as the
client sees them. A second run with the same --seed against the same server process finds its
prompts in that server's prefix cache: restart the server or change --seed between runs.
`--compare A.json B.json ...` prints saved runs side by side.

`--workload` picks the prompts: `chat` (the default, above) or `copy`, where each request asks for a
passage of about --prompt-tokens tokens to be repeated word for word: the output copies its context, as
code edits, rewrites and quoting answers do, which is what speculative decoding by prompt lookup serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_output import format_table, write_report
from loadtest.client import TIMEOUT, Clock, RequestRecord, is_loopback_url, send_chat, served_model
from loadtest.stats import percentile
from loadtest.workload import INTERACTIVE, ChatRequest, LoadTenant, prompt_text

WORDS_PER_TOKEN = 0.75  # English text in a BPE vocabulary; the prompts need only be about the right length
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 4096
DEFAULT_REQUESTS_CAP = 256  # the default N grows with c, but a level should still take minutes, not hours
TENANT_ID = "bench"


@dataclass(slots=True, frozen=True)
class ServeBenchConfig:
    """One run: what to send, to whom, and the bounds that keep it finite."""

    url: str
    concurrency: tuple[int, ...]
    label: str | None = None  # None: the model id
    requests_per_level: int | None = None  # None: default_requests(c) for each level
    max_tokens: int = 128  # generated exactly (ignore_eos)
    prompt_tokens: int = 200  # about: the prompts are words, counted at WORDS_PER_TOKEN
    model: str | None = None  # None: the first id of GET /v1/models
    seed: int = 0
    api_key: str | None = None  # never written to the report
    warmup: int = 1  # requests before each level, not measured
    request_timeout_s: float = 600.0  # one request, start to [DONE]
    max_run_s: float = 3600.0  # the whole run; levels not finished by then are left out
    extra_body: str = ""  # JSON object text merged into every request body (e.g. logprobs, response_format)
    workload: str = "chat"  # one of WORKLOADS

    def check(self) -> None:
        """Raise ValueError for a run outside the caps, before anything is sent."""
        if not self.concurrency or not all(1 <= c <= MAX_CONCURRENCY for c in self.concurrency):
            raise ValueError(f"--concurrency: each level must be 1..{MAX_CONCURRENCY}")
        if self.requests_per_level is not None and not 1 <= self.requests_per_level <= MAX_REQUESTS_PER_LEVEL:
            raise ValueError(f"--requests-per-level must be 1..{MAX_REQUESTS_PER_LEVEL}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.max_tokens < 1 or self.prompt_tokens < 1 or self.warmup < 0:
            raise ValueError("--max-tokens and --prompt-tokens must be >= 1, --warmup >= 0")
        if not 0 < self.request_timeout_s <= self.max_run_s:
            raise ValueError("--request-timeout must be > 0 and at most --max-run-s")
        if self.extra_body:
            try:
                is_object = isinstance(json.loads(self.extra_body), dict)
            except ValueError:
                is_object = False
            if not is_object:
                raise ValueError("--extra-body must be a JSON object")

    def num_requests(self, concurrency: int) -> int:
        return self.requests_per_level or default_requests(concurrency)

    def to_json(self) -> dict[str, Any]:
        settings = {k: v for k, v in asdict(self).items() if k not in ("api_key", "label", "url", "model")}
        return {**settings, "requests_per_level": [self.num_requests(c) for c in self.concurrency]}


def default_requests(concurrency: int) -> int:
    """Enough requests that each of the c slots is refilled at least once, so the level reaches steady state."""
    return min(max(8, 2 * concurrency), DEFAULT_REQUESTS_CAP)


WORKLOADS = ("chat", "copy")


def make_prompts(seed: int, prompt_tokens: int, count: int, workload: str = "chat") -> list[str]:
    """The same prompts for every server. The leading number makes each one distinct from its first
    token, so no request reuses another's prefix cache beyond the chat template."""
    rng = random.Random(f"serve/{seed}/{prompt_tokens}" + ("" if workload == "chat" else f"/{workload}"))
    num_words = max(1, round(WORDS_PER_TOKEN * prompt_tokens))
    if workload == "copy":
        return [f"{i}. Repeat the following passage exactly, word for word, and nothing else.\n\n"
                f"{prompt_text(rng, num_words)}" for i in range(count)]
    return [f"{i}. {prompt_text(rng, num_words)}" for i in range(count)]


@dataclass(slots=True, frozen=True)
class LevelResult:
    """One concurrency level, as written to the report; times in ms, None where nothing was measured."""

    concurrency: int
    requests: int
    num_errors: int
    errors: dict[str, int]  # outcome (an HTTP status or a client-side kind) -> count
    completion_tokens: int  # from usage; content chunks for a response without usage
    wall_s: float  # first send to last finish
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None  # over every gap between content chunks of every request of the level
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    loadavg_start: tuple[float, float, float]  # this machine's: a busy client skews the numbers
    loadavg_end: tuple[float, float, float]


def summarize_level(concurrency: int, records: Sequence[RequestRecord], wall_s: float,
                    loadavg: tuple[tuple[float, float, float], tuple[float, float, float]]) -> LevelResult:
    errors = Counter(r.outcome for r in records if r.is_error)
    tokens = sum(r.completion_tokens for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    gaps = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2es = [r.e2e_s for r in records if r.e2e_s is not None and not r.is_error]
    return LevelResult(concurrency, len(records), sum(errors.values()), dict(errors), tokens, round(wall_s, 4),
                       round(tokens / wall_s, 2) if wall_s > 0 else 0.0, _ms(ttfts, 50), _ms(ttfts, 99),
                       _ms(gaps, 50), _ms(gaps, 99), _ms(e2es, 50), *loadavg)


def _ms(seconds: Sequence[float], q: float) -> float | None:
    found = percentile(seconds, q)
    return None if found is None else round(1000 * found, 3)


# ---- the run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class ServeRun:
    model: str
    levels: list[LevelResult]
    is_cut_short: bool = False  # --max-run-s ended it before every level was done


async def _timed_request(http: httpx.AsyncClient, model: str, request: ChatRequest, timeout_s: float,
                         clock: Clock) -> RequestRecord:
    record = RequestRecord(TENANT_ID, INTERACTIVE, sent_at=clock())
    try:
        # httpx's timeout bounds each read; this bounds the whole request, however slowly it trickles.
        async with asyncio.timeout(timeout_s):
            await send_chat(http, model, request, record, clock)
    except TimeoutError:
        record.outcome = TIMEOUT
        record.e2e_s = clock() - record.sent_at
    return record


async def _run_requests(http: httpx.AsyncClient, model: str, requests: Sequence[ChatRequest], concurrency: int,
                        timeout_s: float, clock: Clock) -> list[RequestRecord]:
    """Every request, at most `concurrency` in flight: each worker takes the next one as its last ends."""
    pending = iter(requests)  # shared by the workers; safe, as taking the next item never awaits
    records: list[RequestRecord] = []

    async def worker() -> None:
        for request in pending:
            records.append(await _timed_request(http, model, request, timeout_s, clock))

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(requests))):
            group.create_task(worker())
    return records


def _requests(config: ServeBenchConfig, prompts: Sequence[str]) -> list[ChatRequest]:
    tenant = LoadTenant(TENANT_ID, config.api_key)
    return [ChatRequest(tenant, INTERACTIVE, (("user", p),), config.max_tokens, extra_fields=config.extra_body)
            for p in prompts]


async def run_level(config: ServeBenchConfig, model: str, concurrency: int, prompts: Sequence[str]) -> LevelResult:
    """Warm up, then the measured requests; prompts holds the warmup ones first."""
    requests = _requests(config, prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=config.url, limits=limits, timeout=config.request_timeout_s) as http:
        origin = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - origin

        await _run_requests(http, model, requests[:config.warmup], concurrency, config.request_timeout_s, clock)
        loadavg_start = os.getloadavg()
        started = clock()
        records = await _run_requests(http, model, requests[config.warmup:], concurrency, config.request_timeout_s,
                                      clock)
        wall_s = clock() - started
    return summarize_level(concurrency, records, wall_s, (loadavg_start, os.getloadavg()))


async def run_bench(config: ServeBenchConfig) -> ServeRun:
    """Every level in order. Raises httpx.HTTPError when the model cannot be listed."""
    tenant = LoadTenant(TENANT_ID, config.api_key)
    async with httpx.AsyncClient(base_url=config.url, timeout=30) as http:
        run = ServeRun(config.model or await served_model(http, tenant), [])
    sizes = [config.warmup + config.num_requests(c) for c in config.concurrency]
    prompts = make_prompts(config.seed, config.prompt_tokens, sum(sizes), config.workload)  # distinct across levels
    try:
        async with asyncio.timeout(config.max_run_s):
            for concurrency, size in zip(config.concurrency, sizes, strict=True):
                level = await run_level(config, run.model, concurrency, prompts[:size])
                prompts = prompts[size:]
                print(f"c={concurrency}: {level.output_tokens_per_s:,.1f} tokens/s, {level.num_errors} errors",
                      file=sys.stderr)
                run.levels.append(level)
    except TimeoutError:
        run.is_cut_short = True
    return run


# ---- report, compare and command -----------------------------------------------------------------


def report_json(config: ServeBenchConfig, run: ServeRun) -> dict[str, Any]:
    return {"label": config.label or run.model, "url": config.url, "model": run.model, "config": config.to_json(),
            "cut_short": run.is_cut_short, "levels": [asdict(level) for level in run.levels]}


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def levels_table(levels: Sequence[LevelResult]) -> str:
    rows = [["concurrency", "requests", "errors", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
             "E2E p50 ms", "load 1m"]]
    for lv in levels:
        rows.append([str(lv.concurrency), str(lv.requests), str(lv.num_errors), _cell(lv.output_tokens_per_s),
                     _cell(lv.ttft_p50_ms), _cell(lv.ttft_p99_ms), _cell(lv.itl_p50_ms, 2), _cell(lv.itl_p99_ms, 2),
                     _cell(lv.e2e_p50_ms), f"{lv.loadavg_start[0]:.1f}->{lv.loadavg_end[0]:.1f}"])
    return format_table(rows)


COMPARED = (("output_tokens_per_s", "tok/s"), ("itl_p50_ms", "ITL p50 ms"), ("ttft_p50_ms", "TTFT p50 ms"))


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def compare_table(reports: Sequence[dict[str, Any]]) -> str:
    """Per concurrency, each report's tok/s, ITL p50 and TTFT p50, each with its ratio to the first report's."""
    by_level = [{lv["concurrency"]: lv for lv in report["levels"]} for report in reports]
    header = ["concurrency", "label"]
    for _, title in COMPARED:
        header += [title, "vs first"]
    rows = [header]
    for concurrency in sorted({c for levels in by_level for c in levels}):
        base = by_level[0].get(concurrency, {})
        for report, levels in zip(reports, by_level, strict=True):
            level = levels.get(concurrency, {})
            row = [str(concurrency), str(report["label"])]
            for key, _ in COMPARED:
                row += [_cell(level.get(key), 2), _ratio(level.get(key), base.get(key))]
            rows.append(row)
    return format_table(rows)


def _load_reports(paths: Sequence[str]) -> list[dict[str, Any]]:
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if not isinstance(report, dict) or not isinstance(report.get("levels"), list) or "label" not in report:
            raise ValueError(f"{path} is not a `fairlane bench serve` report")
        reports.append(report)
    return reports


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="streamed chat throughput and latency of any OpenAI-compatible "
                                                 "server, over HTTP")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated requests in flight per level")
    parser.add_argument("--requests-per-level", type=int,
                        help=f"measured requests per level (default max(8, 2*c), at most {DEFAULT_REQUESTS_CAP})")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (ignore_eos)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="about this many prompt tokens per request")
    parser.add_argument("--model", help="the model to ask for (default: the first of GET /v1/models)")
    parser.add_argument("--label", help="this run's name in reports and --compare (default: the model id)")
    parser.add_argument("--seed", type=int, default=0,
                        help="picks the prompts; change it to rerun against a server whose prefix cache still "
                             "holds an earlier run's prompts")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'; never written to the report")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each level")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--max-run-s", type=float, default=3600.0, help="seconds the whole run may take")
    parser.add_argument("--allow-remote", action="store_true", help="allow a URL that is not on this machine")
    parser.add_argument("--extra-body", default="",
                        help="a JSON object merged into every request body, e.g. '{\"logprobs\": true}'")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat",
                        help="chat: seeded filler prompts; copy: each asks for its passage repeated word for word")
    parser.add_argument("--out", help="write the report as JSON here")
    parser.add_argument("--compare", nargs="+", metavar="REPORT",
                        help="print these saved reports side by side (ratios to the first) instead of running")
    parser.set_defaults(handler=run_command)


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError as exc:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from exc
    config = ServeBenchConfig(args.url.rstrip("/"), concurrency, args.label, args.requests_per_level, args.max_tokens,
                              args.prompt_tokens, args.model, args.seed, args.api_key, args.warmup,
                              args.request_timeout, args.max_run_s, args.extra_body, args.workload)
    config.check()
    return config


def run_command(args: argparse.Namespace) -> int:
    """0 when every request succeeded, 1 when some failed or the run was cut short, 2 for a refused run."""
    if args.compare:
        return _compare_command(args.compare)
    if not is_loopback_url(args.url) and not args.allow_remote:
        print(f"error: {args.url} is not a loopback address; pass --allow-remote to load another machine",
              file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        run = asyncio.run(run_bench(config))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: cannot use the server at {args.url}: {exc!r}", file=sys.stderr)
        return 2
    print(levels_table(run.levels) if run.levels else "no level finished")
    write_report(args.out, report_json(config, run))
    if run.is_cut_short:
        print(f"error: --max-run-s {config.max_run_s:g} ended the run after {len(run.levels)} level(s)",
              file=sys.stderr)
    return 1 if run.is_cut_short or any(level.num_errors for level in run.levels) else 0


def _compare_command(paths: Sequence[str]) -> int:
    try:
        reports = _load_reports(paths)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(compare_table(reports))
    return 0
