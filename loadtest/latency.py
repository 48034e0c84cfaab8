"""`python -m loadtest latency`: interactive TTFT and ITL as load grows, against one stream alone.

Phases against one server, each for `phase_seconds` after a short warm-up (requests that began in the
warm-up are not counted), in this order:
1. alone: one closed-loop interactive stream;
2. interactive: `interactive_streams` of them;
3. flood: the same streams beside `batch_streams` closed-loop batch streams (`service_tier: flex`).
Every request has a seeded prompt of about `prompt_words` words (its own first words, so no prefix is
shared) and generates exactly `max_tokens` tokens (`ignore_eos`); the streams start a moment apart so
their requests do not arrive in lockstep. Any OpenAI-compatible server can be measured (llama.cpp's
ignores `service_tier`: its "batch" streams are plain ones). For a phase on a freshly started server,
run one phase per server with `--phases`, and give the earlier runs' reports to the last with `--with`:
its report then holds every phase and the ratios. `--peer` takes another server's report (llama.cpp's,
run the same way) and adds the flood's batch tokens/s against the peer's.

The report: per phase, TTFT and ITL p50/p99 of the interactive requests, batch output tokens/s, errors,
and the ratios to the alone phase; it passes when the ratios are within the targets given.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_output import format_table, write_run_report
from loadtest.client import OK, RequestRecord, send_chat, served_model
from loadtest.stats import percentile
from loadtest.workload import BATCH, INTERACTIVE, ChatRequest, LoadTenant, prompt_text

PHASES = ("alone", "interactive", "flood")
WARMUP_S = 5.0


@dataclass(slots=True, frozen=True)
class LatencyConfig:
    url: str
    tenant: LoadTenant
    phases: tuple[str, ...] = PHASES
    phase_seconds: float = 60.0
    interactive_streams: int = 4
    batch_streams: int = 24
    prompt_words: int = 45  # about 60 tokens, 90 with the chat template
    max_tokens: int = 64
    seed: int = 0
    warmup_s: float = WARMUP_S  # of each phase, not measured
    targets: dict[str, float] = field(default_factory=lambda: {
        "interactive.ttft_p50": 1.5, "interactive.itl_p50": 2.0,
        "flood.ttft_p50": 1.5, "flood.ttft_p99": 3.0, "flood.itl_p50": 2.0})
    batch_floor_vs_peer: float = 0.5  # the flood's batch tokens/s at least this times a peer report's

    def check(self) -> None:
        unknown = set(self.phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)} (choose from {', '.join(PHASES)})")
        if self.phase_seconds <= 0 or self.interactive_streams < 1 or self.batch_streams < 0:
            raise ValueError("phase seconds and stream counts must be positive")


@dataclass(slots=True)
class PhaseResult:
    name: str
    window: tuple[float, float]  # the measured part of the phase, in time.monotonic()
    interactive: list[RequestRecord]  # sent within the window
    batch: list[RequestRecord]  # every one: their chunks within the window are counted

    @property
    def seconds(self) -> float:
        return self.window[1] - self.window[0]

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.interactive if r.outcome == OK]
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        gaps = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
        start, end = self.window
        batch_tokens = sum(tokens_within(r, start, end) for r in self.batch)
        return {
            "phase": self.name, "interactive_requests": len(done),
            "errors": sum(r.outcome != OK for r in [*self.interactive, *self.batch]),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "batch_requests": sum(r.outcome == OK for r in self.batch),
            "batch_tokens_per_s": batch_tokens / self.seconds,
        }


def tokens_within(record: RequestRecord, start: float, end: float) -> float:
    """A request's output tokens (its usage) made within [start, end]: its first at its first chunk, the others
    spread evenly up to its last chunk. Chunks alone undercount: a server may send a stream that fell behind
    its pending tokens as one chunk (fairlane's `stream_coalesce`), where llama.cpp's sends a token a chunk."""
    times = record.chunk_times
    if not times:
        return 0.0
    tokens = max(record.completion_tokens, len(times))
    first, last = times[0], times[-1]
    counted = float(start <= first <= end)
    if last > first:
        counted += (tokens - 1) * max(0.0, min(end, last) - max(start, first)) / (last - first)
    elif start <= first <= end:
        counted = float(tokens)
    return counted


class PhaseRun:
    def __init__(self, config: LatencyConfig, http: httpx.AsyncClient, model: str, name: str) -> None:
        self.config, self.http, self.model, self.name = config, http, model, name
        self.rng = random.Random(f"{config.seed}-{name}")
        self.started = time.monotonic()
        self.counted_from = self.started + config.warmup_s
        self.ends_at = self.counted_from + config.phase_seconds
        self.records: dict[str, list[RequestRecord]] = {INTERACTIVE: [], BATCH: []}

    def request(self, klass: str) -> ChatRequest:
        opening = f"Request {self.rng.randrange(10**9)}."  # no two prompts share a prefix
        text = f"{opening} {prompt_text(self.rng, self.config.prompt_words)}"
        return ChatRequest(self.config.tenant, klass, (("user", text),), self.config.max_tokens)

    async def stream(self, klass: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # a stagger, so the streams' requests do not arrive in lockstep
        while time.monotonic() < self.ends_at:
            sent_at = time.monotonic()
            record = RequestRecord(self.config.tenant.tenant_id, klass, sent_at)
            await send_chat(self.http, self.model, self.request(klass), record, time.monotonic)
            if klass == BATCH or self.counted_from <= sent_at:
                self.records[klass].append(record)

    async def run(self) -> PhaseResult:
        num_interactive = 1 if self.name == "alone" else self.config.interactive_streams
        num_batch = self.config.batch_streams if self.name == "flood" else 0
        stagger = 1.0 / max(1, num_interactive)
        streams = [self.stream(INTERACTIVE, i * stagger) for i in range(num_interactive)]
        streams += [self.stream(BATCH, i * 0.05) for i in range(num_batch)]
        await asyncio.gather(*streams)
        return PhaseResult(self.name, (self.counted_from, self.ends_at), self.records[INTERACTIVE],
                           self.records[BATCH])


async def run_latency(config: LatencyConfig) -> list[PhaseResult]:
    config.check()
    limits = httpx.Limits(max_connections=config.interactive_streams + config.batch_streams + 8)
    async with httpx.AsyncClient(base_url=config.url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        model = await served_model(http, config.tenant)
        return [await PhaseRun(config, http, model, name).run() for name in config.phases]


def build_latency_report(config: LatencyConfig, phases: Sequence[PhaseResult], load: Sequence[float],
                         earlier: Sequence[dict[str, Any]] = (), peer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The phases run, beside those of `earlier` reports (each phase on its own freshly started server: a
    phase run here replaces an earlier one of its name), their ratios to the alone phase, and with a `peer`
    report (another server's, same command) the flood's batch tokens/s against the peer's."""
    run = {p.name: p.summary() for p in phases}
    gathered = {name: summary for report in earlier for name, summary in report["phases"].items()} | run
    summaries = {name: gathered[name] for name in PHASES if name in gathered}
    ratios: dict[str, float | None] = {}
    alone = summaries.get("alone")
    for name, summary in summaries.items():
        if alone is None or name == "alone":
            continue
        for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            base, value = alone[f"{key}_s"], summary[f"{key}_s"]
            ratios[f"{name}.{key}"] = value / base if base and value is not None else None
    missed = [f"{key} {ratios[key]:.2f}x > {limit}x" for key, limit in config.targets.items()
              if ratios.get(key) is not None and ratios[key] > limit]  # type: ignore[operator]
    peer_tokens_per_s = _flood_batch_tokens_per_s(peer)
    peer_batch = (summaries["flood"]["batch_tokens_per_s"] / peer_tokens_per_s
                  if peer_tokens_per_s and "flood" in summaries else None)
    if peer_batch is not None and peer_batch < config.batch_floor_vs_peer:
        missed.append(f"flood.batch_vs_peer {peer_batch:.2f}x < {config.batch_floor_vs_peer}x")
    errors = sum(s["errors"] for s in summaries.values())
    return {"config": {k: v for k, v in asdict(config).items() if k != "tenant"}, "load_average": list(load),
            "phases": summaries, "ratios_to_alone": ratios, "batch_vs_peer": peer_batch,
            "peer_batch_tokens_per_s": peer_tokens_per_s,
            "missed": missed, "passed": not missed and not errors}


def _flood_batch_tokens_per_s(report: dict[str, Any] | None) -> float | None:
    """A report's flood batch tokens/s, if it ran a flood."""
    flood = None if report is None else report["phases"].get("flood")
    return None if flood is None else float(flood["batch_tokens_per_s"])


def latency_table(report: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:,.0f}"

    rows = []
    for name, s in report["phases"].items():
        rows.append([name, str(s["interactive_requests"]), str(s["errors"]), ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]),
                     ms(s["itl_p50_s"]), ms(s["itl_p99_s"]), f"{s['batch_tokens_per_s']:.1f}"])
    table = format_table([["phase", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                           "batch tok/s"], *rows])
    ratios = "\n".join(f"  {key}: {value:.2f}x" for key, value in report["ratios_to_alone"].items() if value)
    if report.get("batch_vs_peer") is not None:
        ratios += (f"\n  flood batch tok/s against the peer's ({report['peer_batch_tokens_per_s']:.1f}): "
                   f"{report['batch_vs_peer']:.2f}x")
    verdict = "passed" if report["passed"] else f"missed: {'; '.join(report['missed']) or 'errors'}"
    return f"{table}\nagainst alone:\n{ratios}\n{verdict}\n"


def write_latency_report(report: dict[str, Any], out_dir: Path) -> str:
    return write_run_report(report, out_dir, latency_table(report))
